from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EntryStatus(_message.Message):
    __slots__ = ("code", "message")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OK: _ClassVar[EntryStatus.Code]
        INVALID_ARGUMENT: _ClassVar[EntryStatus.Code]
        NOT_FOUND: _ClassVar[EntryStatus.Code]
        RESOURCE_EXHAUSTED: _ClassVar[EntryStatus.Code]
        INTERNAL: _ClassVar[EntryStatus.Code]
    OK: EntryStatus.Code
    INVALID_ARGUMENT: EntryStatus.Code
    NOT_FOUND: EntryStatus.Code
    RESOURCE_EXHAUSTED: EntryStatus.Code
    INTERNAL: EntryStatus.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: EntryStatus.Code
    message: str
    def __init__(self, code: _Optional[_Union[EntryStatus.Code, str]] = ..., message: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class HiddenRef(_message.Message):
    __slots__ = ("offset", "rows", "generation", "inline_rows")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    INLINE_ROWS_FIELD_NUMBER: _ClassVar[int]
    offset: int
    rows: int
    generation: int
    inline_rows: bytes
    def __init__(self, offset: _Optional[int] = ..., rows: _Optional[int] = ..., generation: _Optional[int] = ..., inline_rows: _Optional[bytes] = ...) -> None: ...

class HiddenStoreDescriptor(_message.Message):
    __slots__ = ("backend", "name", "capacity_rows", "width", "dtype", "handle", "device")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    backend: str
    name: str
    capacity_rows: int
    width: int
    dtype: str
    handle: bytes
    device: int
    def __init__(self, backend: _Optional[str] = ..., name: _Optional[str] = ..., capacity_rows: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[str] = ..., handle: _Optional[bytes] = ..., device: _Optional[int] = ...) -> None: ...

class DraftDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ServerTiming(_message.Message):
    __slots__ = ("compute_ms", "total_ms")
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    compute_ms: float
    total_ms: float
    def __init__(self, compute_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("epoch", "lease_ms")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_ms: int
    def __init__(self, epoch: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("epoch", "active_sequences", "released_sequences", "ring_rows_in_use")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RING_ROWS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    active_sequences: int
    released_sequences: int
    ring_rows_in_use: int
    def __init__(self, epoch: _Optional[int] = ..., active_sequences: _Optional[int] = ..., released_sequences: _Optional[int] = ..., ring_rows_in_use: _Optional[int] = ...) -> None: ...
