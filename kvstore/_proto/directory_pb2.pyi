from kvstore._proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QuarantineRequest(_message.Message):
    __slots__ = ("purge",)
    PURGE_FIELD_NUMBER: _ClassVar[int]
    purge: bool
    def __init__(self, purge: _Optional[bool] = ...) -> None: ...

class QuarantinedPage(_message.Message):
    __slots__ = ("key", "namespace_id", "reason", "unix_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UNIX_S_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    namespace_id: bytes
    reason: str
    unix_s: float
    def __init__(self, key: _Optional[bytes] = ..., namespace_id: _Optional[bytes] = ..., reason: _Optional[str] = ..., unix_s: _Optional[float] = ...) -> None: ...

class QuarantineResponse(_message.Message):
    __slots__ = ("pages", "purged")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    PURGED_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[QuarantinedPage]
    purged: int
    def __init__(self, pages: _Optional[_Iterable[_Union[QuarantinedPage, _Mapping]]] = ..., purged: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "local_only", "tenant")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    local_only: bool
    tenant: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., local_only: _Optional[bool] = ..., tenant: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_pages", "runs", "generation")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    runs: _containers.RepeatedCompositeFieldContainer[LocationRun]
    generation: int
    def __init__(self, num_pages: _Optional[int] = ..., runs: _Optional[_Iterable[_Union[LocationRun, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class LocationRun(_message.Message):
    __slots__ = ("node", "tier", "num_pages", "size_bytes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    node: str
    tier: str
    num_pages: int
    size_bytes: int
    def __init__(self, node: _Optional[str] = ..., tier: _Optional[str] = ..., num_pages: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class PageRecord(_message.Message):
    __slots__ = ("key", "location")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    location: _common_pb2.Location
    def __init__(self, key: _Optional[bytes] = ..., location: _Optional[_Union[_common_pb2.Location, _Mapping]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("namespace_id", "records", "tenant", "epoch", "generation", "owner_epoch")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OWNER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    records: _containers.RepeatedCompositeFieldContainer[PageRecord]
    tenant: str
    epoch: int
    generation: int
    owner_epoch: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., records: _Optional[_Iterable[_Union[PageRecord, _Mapping]]] = ..., tenant: _Optional[str] = ..., epoch: _Optional[int] = ..., generation: _Optional[int] = ..., owner_epoch: _Optional[int] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, versions: _Optional[_Iterable[int]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "tier", "node", "epoch", "owner_epoch")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OWNER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tier: str
    node: str
    epoch: int
    owner_epoch: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., tier: _Optional[str] = ..., node: _Optional[str] = ..., epoch: _Optional[int] = ..., owner_epoch: _Optional[int] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("num_removed",)
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    def __init__(self, num_removed: _Optional[int] = ...) -> None: ...

class InvalidateRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "generation")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    generation: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., generation: _Optional[int] = ...) -> None: ...

class InvalidateResponse(_message.Message):
    __slots__ = ("num_removed", "generation")
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    generation: int
    def __init__(self, num_removed: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("from_seq",)
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    def __init__(self, from_seq: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "kind", "namespace_id", "key", "location", "unix_ms", "generation")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Event.Kind]
        STORED: _ClassVar[Event.Kind]
        REMOVED: _ClassVar[Event.Kind]
        CLEARED: _ClassVar[Event.Kind]
        RESYNC: _ClassVar[Event.Kind]
    KIND_UNSPECIFIED: Event.Kind
    STORED: Event.Kind
    REMOVED: Event.Kind
    CLEARED: Event.Kind
    RESYNC: Event.Kind
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: Event.Kind
    namespace_id: bytes
    key: bytes
    location: _common_pb2.Location
    unix_ms: int
    generation: int
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[Event.Kind, str]] = ..., namespace_id: _Optional[bytes] = ..., key: _Optional[bytes] = ..., location: _Optional[_Union[_common_pb2.Location, _Mapping]] = ..., unix_ms: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "num_pages", "used_bytes", "capacity_bytes", "hits", "misses", "evictions", "bytes_in", "bytes_out")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    tier: str
    num_pages: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    bytes_in: int
    bytes_out: int
    def __init__(self, tier: _Optional[str] = ..., num_pages: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node", "num_entries", "last_seq", "tiers", "num_leases", "num_quarantined", "ssd", "tenants")
    class SsdEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    NUM_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    SSD_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    node: str
    num_entries: int
    last_seq: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    num_leases: int
    num_quarantined: int
    ssd: _containers.ScalarMap[str, float]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    def __init__(self, node: _Optional[str] = ..., num_entries: _Optional[int] = ..., last_seq: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., num_leases: _Optional[int] = ..., num_quarantined: _Optional[int] = ..., ssd: _Optional[_Mapping[str, float]] = ..., tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "used", "limits")
    class UsedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LimitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TENANT_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    used: _containers.ScalarMap[str, int]
    limits: _containers.ScalarMap[str, int]
    def __init__(self, tenant: _Optional[str] = ..., used: _Optional[_Mapping[str, int]] = ..., limits: _Optional[_Mapping[str, int]] = ...) -> None: ...
