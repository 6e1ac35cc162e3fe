from kvstore._proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GrantTransferRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class GrantTransferResponse(_message.Message):
    __slots__ = ("grant", "ttl_ms")
    GRANT_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    grant: bytes
    ttl_ms: int
    def __init__(self, grant: _Optional[bytes] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "replicas", "holder", "tenant", "page_bytes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    replicas: int
    holder: str
    tenant: str
    page_bytes: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., replicas: _Optional[int] = ..., holder: _Optional[str] = ..., tenant: _Optional[str] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ("num_pages",)
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    def __init__(self, num_pages: _Optional[int] = ...) -> None: ...

class AppendTokensRequest(_message.Message):
    __slots__ = ("namespace_id", "session_id", "expected_length", "tokens", "sync", "prompt_tokens")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    session_id: str
    expected_length: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    sync: bool
    prompt_tokens: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., session_id: _Optional[str] = ..., expected_length: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., sync: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class AppendTokensResponse(_message.Message):
    __slots__ = ("length",)
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    length: int
    def __init__(self, length: _Optional[int] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("namespace_id", "session_id")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    session_id: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., session_id: _Optional[str] = ...) -> None: ...

class GetSessionResponse(_message.Message):
    __slots__ = ("found", "prompt_tokens", "tokens")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    found: bool
    prompt_tokens: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, found: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("namespace_id", "session_id")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    session_id: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HintEntry(_message.Message):
    __slots__ = ("keys", "eta_ms")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ETA_MS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    eta_ms: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., eta_ms: _Optional[int] = ...) -> None: ...

class HintRequest(_message.Message):
    __slots__ = ("namespace_id", "entries")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    entries: _containers.RepeatedCompositeFieldContainer[HintEntry]
    def __init__(self, namespace_id: _Optional[bytes] = ..., entries: _Optional[_Iterable[_Union[HintEntry, _Mapping]]] = ...) -> None: ...

class HintResponse(_message.Message):
    __slots__ = ("reserved",)
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    reserved: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, reserved: _Optional[_Iterable[bool]] = ...) -> None: ...

class WhoAmIRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WhoAmIResponse(_message.Message):
    __slots__ = ("tenant", "rights", "salt")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RIGHTS_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    rights: _containers.RepeatedScalarFieldContainer[str]
    salt: bytes
    def __init__(self, tenant: _Optional[str] = ..., rights: _Optional[_Iterable[str]] = ..., salt: _Optional[bytes] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("node", "arena_path", "arena_bytes", "arena_token", "tiers", "max_pages_per_request", "max_page_bytes", "arena_socket", "call_socket", "call_token", "pool_socket")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MAX_PAGES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MAX_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    CALL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    CALL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POOL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    node: str
    arena_path: str
    arena_bytes: int
    arena_token: bytes
    tiers: _containers.RepeatedScalarFieldContainer[str]
    max_pages_per_request: int
    max_page_bytes: int
    arena_socket: str
    call_socket: str
    call_token: bytes
    pool_socket: str
    def __init__(self, node: _Optional[str] = ..., arena_path: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., arena_token: _Optional[bytes] = ..., tiers: _Optional[_Iterable[str]] = ..., max_pages_per_request: _Optional[int] = ..., max_page_bytes: _Optional[int] = ..., arena_socket: _Optional[str] = ..., call_socket: _Optional[str] = ..., call_token: _Optional[bytes] = ..., pool_socket: _Optional[str] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("namespace_id", "layout", "keys", "parent", "generation", "session_id")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    layout: _common_pb2.Layout
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parent: bytes
    generation: int
    session_id: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., parent: _Optional[bytes] = ..., generation: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("key", "offset", "exists")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    offset: int
    exists: bool
    def __init__(self, key: _Optional[bytes] = ..., offset: _Optional[int] = ..., exists: _Optional[bool] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("allocation_id", "slots", "page_bytes", "ttl_ms", "generation", "arena_token")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ARENA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    allocation_id: bytes
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    page_bytes: int
    ttl_ms: int
    generation: int
    arena_token: bytes
    def __init__(self, allocation_id: _Optional[bytes] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., page_bytes: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., generation: _Optional[int] = ..., arena_token: _Optional[bytes] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("allocation_id", "keys", "checksums", "durable", "flags")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    allocation_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    durable: bool
    flags: int
    def __init__(self, allocation_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., checksums: _Optional[_Iterable[int]] = ..., durable: _Optional[bool] = ..., flags: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("num_published",)
    NUM_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    num_published: int
    def __init__(self, num_published: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("allocation_id",)
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    allocation_id: bytes
    def __init__(self, allocation_id: _Optional[bytes] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "ttl_ms", "device")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_ms: int
    device: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., ttl_ms: _Optional[int] = ..., device: _Optional[bool] = ...) -> None: ...

class AcquiredPage(_message.Message):
    __slots__ = ("key", "offset", "checksum", "on_device", "device_offset")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ON_DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    offset: int
    checksum: int
    on_device: bool
    device_offset: int
    def __init__(self, key: _Optional[bytes] = ..., offset: _Optional[int] = ..., checksum: _Optional[int] = ..., on_device: _Optional[bool] = ..., device_offset: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "pages", "page_bytes", "arena_token", "pool_token", "generation")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POOL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    lease_id: bytes
    pages: _containers.RepeatedCompositeFieldContainer[AcquiredPage]
    page_bytes: int
    arena_token: bytes
    pool_token: bytes
    generation: int
    def __init__(self, lease_id: _Optional[bytes] = ..., pages: _Optional[_Iterable[_Union[AcquiredPage, _Mapping]]] = ..., page_bytes: _Optional[int] = ..., arena_token: _Optional[bytes] = ..., pool_token: _Optional[bytes] = ..., generation: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "failed")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    lease_id: bytes
    failed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, lease_id: _Optional[bytes] = ..., failed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("lease_id", "ttl_ms", "layers_written")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    lease_id: bytes
    ttl_ms: int
    layers_written: int
    def __init__(self, lease_id: _Optional[bytes] = ..., ttl_ms: _Optional[int] = ..., layers_written: _Optional[int] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("key", "namespace_id", "layout", "page_bytes", "checksum", "offset", "data", "durable", "flags", "parent", "generation", "session_id", "next_keys")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_KEYS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    namespace_id: bytes
    layout: _common_pb2.Layout
    page_bytes: int
    checksum: int
    offset: int
    data: bytes
    durable: bool
    flags: int
    parent: bytes
    generation: int
    session_id: str
    next_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, key: _Optional[bytes] = ..., namespace_id: _Optional[bytes] = ..., layout: _Optional[_Union[_common_pb2.Layout, _Mapping]] = ..., page_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., durable: _Optional[bool] = ..., flags: _Optional[int] = ..., parent: _Optional[bytes] = ..., generation: _Optional[int] = ..., session_id: _Optional[str] = ..., next_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WritePagesResponse(_message.Message):
    __slots__ = ("num_published",)
    NUM_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    num_published: int
    def __init__(self, num_published: _Optional[int] = ...) -> None: ...

class ReadPagesRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "chunk_bytes", "ttl_ms", "local_only", "tenant", "generation", "unchecked")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    UNCHECKED_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    chunk_bytes: int
    ttl_ms: int
    local_only: bool
    tenant: str
    generation: int
    unchecked: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., chunk_bytes: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., local_only: _Optional[bool] = ..., tenant: _Optional[str] = ..., generation: _Optional[int] = ..., unchecked: _Optional[bool] = ...) -> None: ...
