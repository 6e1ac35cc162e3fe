from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Location(_message.Message):
    __slots__ = ("node", "tier", "version", "size_bytes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    node: str
    tier: str
    version: int
    size_bytes: int
    def __init__(self, node: _Optional[str] = ..., tier: _Optional[str] = ..., version: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("num_layers", "kv_factor", "num_kv_heads", "head_dim", "dtype", "page_tokens")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_FACTOR_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    kv_factor: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_tokens: int
    def __init__(self, num_layers: _Optional[int] = ..., kv_factor: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., page_tokens: _Optional[int] = ...) -> None: ...
