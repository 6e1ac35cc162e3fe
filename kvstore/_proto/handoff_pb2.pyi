from kvstore._proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenHandoffRequest(_message.Message):
    __slots__ = ("namespace_id", "handoff_id", "to_node", "ttl_ms", "keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    TO_NODE_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    handoff_id: bytes
    to_node: str
    ttl_ms: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., handoff_id: _Optional[bytes] = ..., to_node: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class OpenHandoffResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompleteHandoffRequest(_message.Message):
    __slots__ = ("namespace_id", "handoff_id", "keys", "to_node")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TO_NODE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    handoff_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    to_node: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., handoff_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., to_node: _Optional[str] = ...) -> None: ...

class CompleteHandoffResponse(_message.Message):
    __slots__ = ("num_pages",)
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    def __init__(self, num_pages: _Optional[int] = ...) -> None: ...

class WaitHandoffRequest(_message.Message):
    __slots__ = ("namespace_id", "handoff_id", "keys", "deadline_ms")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    handoff_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    deadline_ms: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., handoff_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class WaitHandoffResponse(_message.Message):
    __slots__ = ("num_pages", "generation")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    generation: int
    def __init__(self, num_pages: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class PushHandoffRequest(_message.Message):
    __slots__ = ("namespace_id", "handoff_id", "keys", "holder", "tenant", "page_bytes", "complete", "ttl_ms")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    handoff_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    holder: str
    tenant: str
    page_bytes: int
    complete: bool
    ttl_ms: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., handoff_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., holder: _Optional[str] = ..., tenant: _Optional[str] = ..., page_bytes: _Optional[int] = ..., complete: _Optional[bool] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class PushHandoffResponse(_message.Message):
    __slots__ = ("num_pages",)
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    def __init__(self, num_pages: _Optional[int] = ...) -> None: ...

class PushLayersRequest(_message.Message):
    __slots__ = ("namespace_id", "handoff_id", "holder", "tenant", "layout", "keys", "offset", "length", "allocation", "ttl_ms")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    handoff_id: bytes
    holder: str
    tenant: str
    layout: _common_pb2.Layout
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    offset: int
    length: int
    allocation: bytes
    ttl_ms: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., handoff_id: _Optional[bytes] = ..., holder: _Optional[str] = ..., tenant: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., allocation: _Optional[bytes] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class PushLayersResponse(_message.Message):
    __slots__ = ("num_pages",)
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    def __init__(self, num_pages: _Optional[int] = ...) -> None: ...
