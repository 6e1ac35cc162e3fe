from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class CopySessionRequest(_message.Message):
    __slots__ = ("namespace_id", "session_id", "source", "keys", "page_bytes", "prompt_tokens", "tokens", "version")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    session_id: str
    source: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    page_bytes: int
    prompt_tokens: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    version: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., session_id: _Optional[str] = ..., source: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., page_bytes: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., version: _Optional[int] = ...) -> None: ...

class CopySessionResponse(_message.Message):
    __slots__ = ("num_pages",)
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    def __init__(self, num_pages: _Optional[int] = ...) -> None: ...

class FenceSessionRequest(_message.Message):
    __slots__ = ("namespace_id", "session_id", "to_node")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TO_NODE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    session_id: str
    to_node: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., session_id: _Optional[str] = ..., to_node: _Optional[str] = ...) -> None: ...

class FenceSessionResponse(_message.Message):
    __slots__ = ("version", "prompt_tokens", "tokens")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    version: int
    prompt_tokens: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class AdoptSessionRequest(_message.Message):
    __slots__ = ("namespace_id", "session_id", "version", "prompt_tokens", "tokens", "force", "source")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    session_id: str
    version: int
    prompt_tokens: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    force: bool
    source: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., session_id: _Optional[str] = ..., version: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., force: _Optional[bool] = ..., source: _Optional[str] = ...) -> None: ...

class AdoptSessionResponse(_message.Message):
    __slots__ = ("version", "num_tokens")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_tokens: int
    def __init__(self, version: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class AbortSessionRequest(_message.Message):
    __slots__ = ("namespace_id", "session_id")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    session_id: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., session_id: _Optional[str] = ...) -> None: ...

class AbortSessionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class SessionStatusRequest(_message.Message):
    __slots__ = ("namespace_id", "session_id", "to_node")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TO_NODE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    session_id: str
    to_node: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., session_id: _Optional[str] = ..., to_node: _Optional[str] = ...) -> None: ...

class SessionStatusResponse(_message.Message):
    __slots__ = ("version", "state", "owner", "cluster_version", "cluster_owner", "to_address", "node")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_OWNER_FIELD_NUMBER: _ClassVar[int]
    TO_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: str
    owner: str
    cluster_version: int
    cluster_owner: str
    to_address: str
    node: str
    def __init__(self, version: _Optional[int] = ..., state: _Optional[str] = ..., owner: _Optional[str] = ..., cluster_version: _Optional[int] = ..., cluster_owner: _Optional[str] = ..., to_address: _Optional[str] = ..., node: _Optional[str] = ...) -> None: ...
