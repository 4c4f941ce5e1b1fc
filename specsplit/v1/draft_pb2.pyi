from specsplit.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftDescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("head_name", "hidden_size", "draft_vocab_size", "target_vocab_size", "aux_layer_ids", "attached", "max_steps", "max_context", "max_sequences", "step_socket", "max_topk", "device")
    HEAD_NAME_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    AUX_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    MAX_TOPK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    head_name: str
    hidden_size: int
    draft_vocab_size: int
    target_vocab_size: int
    aux_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    attached: bool
    max_steps: int
    max_context: int
    max_sequences: int
    step_socket: str
    max_topk: int
    device: str
    def __init__(self, head_name: _Optional[str] = ..., hidden_size: _Optional[int] = ..., draft_vocab_size: _Optional[int] = ..., target_vocab_size: _Optional[int] = ..., aux_layer_ids: _Optional[_Iterable[int]] = ..., attached: _Optional[bool] = ..., max_steps: _Optional[int] = ..., max_context: _Optional[int] = ..., max_sequences: _Optional[int] = ..., step_socket: _Optional[str] = ..., max_topk: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class DraftExtendPropose(_message.Message):
    __slots__ = ("tokens", "hidden", "num_steps", "sampling", "position", "topk", "num_draft_tokens", "earlier", "ahead", "ahead_parents")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EARLIER_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    AHEAD_PARENTS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    hidden: _common_pb2.HiddenRef
    num_steps: int
    sampling: _common_pb2.SamplingParams
    position: int
    topk: int
    num_draft_tokens: int
    earlier: _containers.RepeatedCompositeFieldContainer[_common_pb2.HiddenRef]
    ahead: _containers.RepeatedScalarFieldContainer[int]
    ahead_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[_common_pb2.HiddenRef, _Mapping]] = ..., num_steps: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., position: _Optional[int] = ..., topk: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., earlier: _Optional[_Iterable[_Union[_common_pb2.HiddenRef, _Mapping]]] = ..., ahead: _Optional[_Iterable[int]] = ..., ahead_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftRelease(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftOp(_message.Message):
    __slots__ = ("seq_id", "extend_propose", "release", "traceparent")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    EXTEND_PROPOSE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    extend_propose: DraftExtendPropose
    release: DraftRelease
    traceparent: str
    def __init__(self, seq_id: _Optional[int] = ..., extend_propose: _Optional[_Union[DraftExtendPropose, _Mapping]] = ..., release: _Optional[_Union[DraftRelease, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class ExtendProposeColumns(_message.Message):
    __slots__ = ("seq_ids", "token_counts", "tokens", "hidden_offsets", "hidden_rows", "hidden_generations", "num_steps", "positions", "topks", "num_draft_tokens", "temperatures", "top_ps", "top_ks", "seeds", "earlier_counts", "earlier_offsets", "earlier_rows", "earlier_generations", "traceparents")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOPKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURES_FIELD_NUMBER: _ClassVar[int]
    TOP_PS_FIELD_NUMBER: _ClassVar[int]
    TOP_KS_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    EARLIER_COUNTS_FIELD_NUMBER: _ClassVar[int]
    EARLIER_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    EARLIER_ROWS_FIELD_NUMBER: _ClassVar[int]
    EARLIER_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    hidden_offsets: _containers.RepeatedScalarFieldContainer[int]
    hidden_rows: _containers.RepeatedScalarFieldContainer[int]
    hidden_generations: _containers.RepeatedScalarFieldContainer[int]
    num_steps: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    topks: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    temperatures: _containers.RepeatedScalarFieldContainer[float]
    top_ps: _containers.RepeatedScalarFieldContainer[float]
    top_ks: _containers.RepeatedScalarFieldContainer[int]
    seeds: _containers.RepeatedScalarFieldContainer[int]
    earlier_counts: _containers.RepeatedScalarFieldContainer[int]
    earlier_offsets: _containers.RepeatedScalarFieldContainer[int]
    earlier_rows: _containers.RepeatedScalarFieldContainer[int]
    earlier_generations: _containers.RepeatedScalarFieldContainer[int]
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., token_counts: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., hidden_offsets: _Optional[_Iterable[int]] = ..., hidden_rows: _Optional[_Iterable[int]] = ..., hidden_generations: _Optional[_Iterable[int]] = ..., num_steps: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., topks: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., temperatures: _Optional[_Iterable[float]] = ..., top_ps: _Optional[_Iterable[float]] = ..., top_ks: _Optional[_Iterable[int]] = ..., seeds: _Optional[_Iterable[int]] = ..., earlier_counts: _Optional[_Iterable[int]] = ..., earlier_offsets: _Optional[_Iterable[int]] = ..., earlier_rows: _Optional[_Iterable[int]] = ..., earlier_generations: _Optional[_Iterable[int]] = ..., traceparents: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftStepRequest(_message.Message):
    __slots__ = ("step_id", "ops", "epoch", "extend_proposes")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXTEND_PROPOSES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    ops: _containers.RepeatedCompositeFieldContainer[DraftOp]
    epoch: int
    extend_proposes: ExtendProposeColumns
    def __init__(self, step_id: _Optional[int] = ..., ops: _Optional[_Iterable[_Union[DraftOp, _Mapping]]] = ..., epoch: _Optional[int] = ..., extend_proposes: _Optional[_Union[ExtendProposeColumns, _Mapping]] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("seq_id", "status", "draft_ids", "draft_dists", "consumed_generation", "draft_parents", "ahead")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTS_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    status: _common_pb2.EntryStatus
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_dists: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftDistribution]
    consumed_generation: int
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    ahead: _containers.RepeatedCompositeFieldContainer[AheadOutcome]
    def __init__(self, seq_id: _Optional[int] = ..., status: _Optional[_Union[_common_pb2.EntryStatus, _Mapping]] = ..., draft_ids: _Optional[_Iterable[int]] = ..., draft_dists: _Optional[_Iterable[_Union[_common_pb2.DraftDistribution, _Mapping]]] = ..., consumed_generation: _Optional[int] = ..., draft_parents: _Optional[_Iterable[int]] = ..., ahead: _Optional[_Iterable[_Union[AheadOutcome, _Mapping]]] = ...) -> None: ...

class AheadOutcome(_message.Message):
    __slots__ = ("accepted", "bonus", "draft_ids", "draft_parents", "node")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    bonus: int
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    node: int
    def __init__(self, accepted: _Optional[int] = ..., bonus: _Optional[int] = ..., draft_ids: _Optional[_Iterable[int]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., node: _Optional[int] = ...) -> None: ...

class DraftResultColumns(_message.Message):
    __slots__ = ("seq_ids", "draft_counts", "draft_ids", "tree", "draft_parents", "consumed_generations")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_counts: _containers.RepeatedScalarFieldContainer[int]
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    tree: _containers.RepeatedScalarFieldContainer[bool]
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    consumed_generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., draft_counts: _Optional[_Iterable[int]] = ..., draft_ids: _Optional[_Iterable[int]] = ..., tree: _Optional[_Iterable[bool]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., consumed_generations: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftStepResponse(_message.Message):
    __slots__ = ("step_id", "results", "timing", "ok")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    results: _containers.RepeatedCompositeFieldContainer[DraftResult]
    timing: _common_pb2.ServerTiming
    ok: DraftResultColumns
    def __init__(self, step_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[DraftResult, _Mapping]]] = ..., timing: _Optional[_Union[_common_pb2.ServerTiming, _Mapping]] = ..., ok: _Optional[_Union[DraftResultColumns, _Mapping]] = ...) -> None: ...

class DraftStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftStats(_message.Message):
    __slots__ = ("active_sequences", "free_kv_slots", "graphs_captured_while_serving", "steps_past_graph_budget", "graph_capture_ms_while_serving")
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_CAPTURED_WHILE_SERVING_FIELD_NUMBER: _ClassVar[int]
    STEPS_PAST_GRAPH_BUDGET_FIELD_NUMBER: _ClassVar[int]
    GRAPH_CAPTURE_MS_WHILE_SERVING_FIELD_NUMBER: _ClassVar[int]
    active_sequences: int
    free_kv_slots: int
    graphs_captured_while_serving: int
    steps_past_graph_budget: int
    graph_capture_ms_while_serving: int
    def __init__(self, active_sequences: _Optional[int] = ..., free_kv_slots: _Optional[int] = ..., graphs_captured_while_serving: _Optional[int] = ..., steps_past_graph_budget: _Optional[int] = ..., graph_capture_ms_while_serving: _Optional[int] = ...) -> None: ...
