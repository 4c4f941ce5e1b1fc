from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("mode", "num_steps", "topk", "num_draft_tokens")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DEFAULT: _ClassVar[Speculation.Mode]
        OFF: _ClassVar[Speculation.Mode]
        ON: _ClassVar[Speculation.Mode]
    DEFAULT: Speculation.Mode
    OFF: Speculation.Mode
    ON: Speculation.Mode
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mode: Speculation.Mode
    num_steps: int
    topk: int
    num_draft_tokens: int
    def __init__(self, mode: _Optional[_Union[Speculation.Mode, str]] = ..., num_steps: _Optional[int] = ..., topk: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "token_ids", "raw_text", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "speculation")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RAW_TEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    token_ids: TokenIds
    raw_text: str
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    speculation: Speculation
    def __init__(self, prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., raw_text: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("enabled", "num_steps", "cycles", "mean_accepted_length", "accepted_length_histogram", "draft_ms", "verify_ms", "draft_compute_ms", "verify_compute_ms", "topk", "num_draft_tokens", "adaptive", "num_steps_histogram", "draft_service_ms", "verify_service_ms", "draft_ahead_hits", "draft_ahead_misses")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    CYCLES_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LENGTH_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SERVICE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SERVICE_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_MISSES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    num_steps: int
    cycles: int
    mean_accepted_length: float
    accepted_length_histogram: _containers.RepeatedScalarFieldContainer[int]
    draft_ms: float
    verify_ms: float
    draft_compute_ms: float
    verify_compute_ms: float
    topk: int
    num_draft_tokens: int
    adaptive: bool
    num_steps_histogram: _containers.RepeatedScalarFieldContainer[int]
    draft_service_ms: float
    verify_service_ms: float
    draft_ahead_hits: int
    draft_ahead_misses: int
    def __init__(self, enabled: _Optional[bool] = ..., num_steps: _Optional[int] = ..., cycles: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., accepted_length_histogram: _Optional[_Iterable[int]] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., draft_compute_ms: _Optional[float] = ..., verify_compute_ms: _Optional[float] = ..., topk: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., adaptive: _Optional[bool] = ..., num_steps_histogram: _Optional[_Iterable[int]] = ..., draft_service_ms: _Optional[float] = ..., verify_service_ms: _Optional[float] = ..., draft_ahead_hits: _Optional[int] = ..., draft_ahead_misses: _Optional[int] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "usage", "speculation", "elapsed_ms", "first_token_ms", "matched_stop_token")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    speculation: SpeculationStats
    elapsed_ms: float
    first_token_ms: float
    matched_stop_token: int
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ..., elapsed_ms: _Optional[float] = ..., first_token_ms: _Optional[float] = ..., matched_stop_token: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "final")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    final: Final
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "draft_name", "max_context", "max_new_tokens_cap", "default_num_steps", "max_num_steps", "draft_available", "default_topk", "max_topk", "default_num_draft_tokens", "max_num_draft_tokens")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_CAP_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TOPK_FIELD_NUMBER: _ClassVar[int]
    MAX_TOPK_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    draft_name: str
    max_context: int
    max_new_tokens_cap: int
    default_num_steps: int
    max_num_steps: int
    draft_available: bool
    default_topk: int
    max_topk: int
    default_num_draft_tokens: int
    max_num_draft_tokens: int
    def __init__(self, model_name: _Optional[str] = ..., draft_name: _Optional[str] = ..., max_context: _Optional[int] = ..., max_new_tokens_cap: _Optional[int] = ..., default_num_steps: _Optional[int] = ..., max_num_steps: _Optional[int] = ..., draft_available: _Optional[bool] = ..., default_topk: _Optional[int] = ..., max_topk: _Optional[int] = ..., default_num_draft_tokens: _Optional[int] = ..., max_num_draft_tokens: _Optional[int] = ...) -> None: ...
