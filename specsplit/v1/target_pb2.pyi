from specsplit.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetDescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "hidden_size", "num_layers", "max_context", "max_sequences", "eos_token_ids", "aux_layer_ids", "hidden_store", "tp_size", "dtype", "max_draft_tokens", "step_socket", "device")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    AUX_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STORE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_context: int
    max_sequences: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    aux_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_store: _common_pb2.HiddenStoreDescriptor
    tp_size: int
    dtype: str
    max_draft_tokens: int
    step_socket: str
    device: str
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., max_context: _Optional[int] = ..., max_sequences: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., aux_layer_ids: _Optional[_Iterable[int]] = ..., hidden_store: _Optional[_Union[_common_pb2.HiddenStoreDescriptor, _Mapping]] = ..., tp_size: _Optional[int] = ..., dtype: _Optional[str] = ..., max_draft_tokens: _Optional[int] = ..., step_socket: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class TargetPrefill(_message.Message):
    __slots__ = ("prompt_ids", "sampling", "capture_hidden", "start", "more")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    capture_hidden: bool
    start: int
    more: bool
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., capture_hidden: _Optional[bool] = ..., start: _Optional[int] = ..., more: _Optional[bool] = ...) -> None: ...

class TargetVerify(_message.Message):
    __slots__ = ("draft_ids", "draft_dists", "capture_hidden", "draft_parents", "forced_accept", "decode_tokens")
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTS_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    FORCED_ACCEPT_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_dists: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftDistribution]
    capture_hidden: bool
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    forced_accept: int
    decode_tokens: int
    def __init__(self, draft_ids: _Optional[_Iterable[int]] = ..., draft_dists: _Optional[_Iterable[_Union[_common_pb2.DraftDistribution, _Mapping]]] = ..., capture_hidden: _Optional[bool] = ..., draft_parents: _Optional[_Iterable[int]] = ..., forced_accept: _Optional[int] = ..., decode_tokens: _Optional[int] = ...) -> None: ...

class TargetRelease(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetRecapture(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetSuspend(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetResume(_message.Message):
    __slots__ = ("capture_hidden",)
    CAPTURE_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    capture_hidden: bool
    def __init__(self, capture_hidden: _Optional[bool] = ...) -> None: ...

class TargetOp(_message.Message):
    __slots__ = ("seq_id", "prefill", "verify", "release", "recapture", "suspend", "resume", "traceparent")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    RECAPTURE_FIELD_NUMBER: _ClassVar[int]
    SUSPEND_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    prefill: TargetPrefill
    verify: TargetVerify
    release: TargetRelease
    recapture: TargetRecapture
    suspend: TargetSuspend
    resume: TargetResume
    traceparent: str
    def __init__(self, seq_id: _Optional[int] = ..., prefill: _Optional[_Union[TargetPrefill, _Mapping]] = ..., verify: _Optional[_Union[TargetVerify, _Mapping]] = ..., release: _Optional[_Union[TargetRelease, _Mapping]] = ..., recapture: _Optional[_Union[TargetRecapture, _Mapping]] = ..., suspend: _Optional[_Union[TargetSuspend, _Mapping]] = ..., resume: _Optional[_Union[TargetResume, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class VerifyColumns(_message.Message):
    __slots__ = ("seq_ids", "capture_hidden", "draft_counts", "draft_ids", "tree", "draft_parents", "forced_accept", "traceparents", "decode_tokens")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    FORCED_ACCEPT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    capture_hidden: _containers.RepeatedScalarFieldContainer[bool]
    draft_counts: _containers.RepeatedScalarFieldContainer[int]
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    tree: _containers.RepeatedScalarFieldContainer[bool]
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    forced_accept: _containers.RepeatedScalarFieldContainer[int]
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    decode_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., capture_hidden: _Optional[_Iterable[bool]] = ..., draft_counts: _Optional[_Iterable[int]] = ..., draft_ids: _Optional[_Iterable[int]] = ..., tree: _Optional[_Iterable[bool]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., forced_accept: _Optional[_Iterable[int]] = ..., traceparents: _Optional[_Iterable[str]] = ..., decode_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class TargetStepRequest(_message.Message):
    __slots__ = ("step_id", "ops", "release_generations", "epoch", "verifies")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERIFIES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    ops: _containers.RepeatedCompositeFieldContainer[TargetOp]
    release_generations: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    verifies: VerifyColumns
    def __init__(self, step_id: _Optional[int] = ..., ops: _Optional[_Iterable[_Union[TargetOp, _Mapping]]] = ..., release_generations: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ..., verifies: _Optional[_Union[VerifyColumns, _Mapping]] = ...) -> None: ...

class TargetResult(_message.Message):
    __slots__ = ("seq_id", "status", "tokens", "num_accepted", "hidden")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    status: _common_pb2.EntryStatus
    tokens: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    hidden: _common_pb2.HiddenRef
    def __init__(self, seq_id: _Optional[int] = ..., status: _Optional[_Union[_common_pb2.EntryStatus, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., hidden: _Optional[_Union[_common_pb2.HiddenRef, _Mapping]] = ...) -> None: ...

class ResultColumns(_message.Message):
    __slots__ = ("seq_ids", "token_counts", "tokens", "num_accepted", "hidden_rows", "hidden_offsets", "hidden_generations")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: _containers.RepeatedScalarFieldContainer[int]
    hidden_rows: _containers.RepeatedScalarFieldContainer[int]
    hidden_offsets: _containers.RepeatedScalarFieldContainer[int]
    hidden_generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., token_counts: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[_Iterable[int]] = ..., hidden_rows: _Optional[_Iterable[int]] = ..., hidden_offsets: _Optional[_Iterable[int]] = ..., hidden_generations: _Optional[_Iterable[int]] = ...) -> None: ...

class TargetStepResponse(_message.Message):
    __slots__ = ("step_id", "results", "timing", "ok")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    results: _containers.RepeatedCompositeFieldContainer[TargetResult]
    timing: _common_pb2.ServerTiming
    ok: ResultColumns
    def __init__(self, step_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[TargetResult, _Mapping]]] = ..., timing: _Optional[_Union[_common_pb2.ServerTiming, _Mapping]] = ..., ok: _Optional[_Union[ResultColumns, _Mapping]] = ...) -> None: ...

class TargetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetStats(_message.Message):
    __slots__ = ("active_sequences", "free_kv_slots", "ring_rows_in_use", "ring_live_allocations", "graphs_captured_while_serving", "steps_past_graph_budget", "graph_capture_ms_while_serving")
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RING_ROWS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    RING_LIVE_ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_CAPTURED_WHILE_SERVING_FIELD_NUMBER: _ClassVar[int]
    STEPS_PAST_GRAPH_BUDGET_FIELD_NUMBER: _ClassVar[int]
    GRAPH_CAPTURE_MS_WHILE_SERVING_FIELD_NUMBER: _ClassVar[int]
    active_sequences: int
    free_kv_slots: int
    ring_rows_in_use: int
    ring_live_allocations: int
    graphs_captured_while_serving: int
    steps_past_graph_budget: int
    graph_capture_ms_while_serving: int
    def __init__(self, active_sequences: _Optional[int] = ..., free_kv_slots: _Optional[int] = ..., ring_rows_in_use: _Optional[int] = ..., ring_live_allocations: _Optional[int] = ..., graphs_captured_while_serving: _Optional[int] = ..., steps_past_graph_budget: _Optional[int] = ..., graph_capture_ms_while_serving: _Optional[int] = ...) -> None: ...
