"""Plain-Python operations and results of the two engines (gRPC stays at the edge:
specsplit.transport.wire converts these to and from the protos)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class Code(IntEnum):  # mirrors specsplit.v1.EntryStatus.Code
    OK = 0
    INVALID_ARGUMENT = 1
    NOT_FOUND = 2
    RESOURCE_EXHAUSTED = 3
    INTERNAL = 4


class OpError(Exception):
    """An entry-level failure: reported in that entry's status, the batch goes on."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class HiddenRef:
    offset: int
    rows: int
    generation: int
    inline: bytes = b""


# (target token ids, probabilities) of one draft position, nonzero entries only
SparseDist = tuple[list[int], list[float]]


@dataclass
class Prefill:
    """A prompt into a new sequence, or a part of it (chunked prefill): prompt_ids are its tokens
    from `start` on; with `more`, the prompt goes on in a later Prefill and nothing is generated."""

    seq_id: int
    prompt_ids: list[int]
    sampling: Sampling = field(default_factory=Sampling)
    capture: bool = True
    trace: str = ""  # W3C traceparent of the cycle this op belongs to
    start: int = 0  # prompt tokens earlier Prefills of this sequence hold (0: a new sequence)
    more: bool = False


@dataclass
class Verify:
    seq_id: int
    draft_ids: list[int] = field(default_factory=list)
    draft_dists: list[SparseDist] = field(default_factory=list)
    # a tree: the index of each draft's parent in draft_ids (-1: the sequence's last token); empty: a chain
    draft_parents: list[int] = field(default_factory=list)
    capture: bool = True
    trace: str = ""
    forced: int = -1  # benchmark only (--benchmark-forced-acceptance): accept this many drafts; -1: verify
    # no drafts, nothing captured, greedy: decode this many tokens in a row, each the argmax after the one before
    decode: int = 1


@dataclass
class Release:
    seq_id: int
    trace: str = ""


@dataclass
class Recapture:
    """Recompute the features of every committed position of a sequence (for a draft
    that lost its state); the sequence itself is untouched."""

    seq_id: int
    trace: str = ""


@dataclass
class Suspend:
    """Give up a sequence's KV slot but keep the sequence (its tokens, its sampler's state):
    the slot goes to another client's request."""

    seq_id: int
    trace: str = ""


@dataclass
class Resume:
    """A suspended sequence back in a slot: its committed tokens prefilled again (with their
    features for the draft when `capture`, paired as a Recapture's); then it goes on where
    it stopped."""

    seq_id: int
    capture: bool = True
    trace: str = ""


TargetOp = Prefill | Verify | Release | Recapture | Suspend | Resume


@dataclass
class TargetResult:
    seq_id: int
    code: Code = Code.OK
    message: str = ""
    tokens: list[int] = field(default_factory=list)  # accepted drafts + the target's own token
    # (a Verify's decode of n tokens: the n; Recapture: the tokens to extend the draft with, one per feature row)
    num_accepted: int = 0
    hidden: HiddenRef | None = None
    started_ns: int = 0  # engine time of this entry (local only, for server-side spans)
    ended_ns: int = 0


MAX_EARLIER = 64  # feature references of extends put off (ExtendPropose.earlier), at most
PUT_OFF_TOKENS = 32  # a sequence's extend is put off while fewer tokens wait; the draft runs extends this long padded


@dataclass
class ExtendPropose:
    seq_id: int
    tokens: list[int]
    hidden: HiddenRef
    num_steps: int
    sampling: Sampling = field(default_factory=Sampling)
    trace: str = ""
    position: int = 0  # position of the first row; 0 (re)starts the sequence
    topk: int = 1  # > 1: propose a tree (greedy only), num_steps deep, branching topk per expanded node
    num_draft_tokens: int = 0  # a tree's size counting the root (SGLang's meaning): keeps num_draft_tokens - 1 drafts
    earlier: list[HiddenRef] = field(default_factory=list)  # rows before `hidden`'s, in order (extends put off)
    # drafting ahead (greedy): after the extend (`tokens` may then be empty), the drafts being verified now (a
    # tree: with ahead_parents, as Verify's); the draft proposes the next cycle's drafts for outcomes of that
    # verify (AheadOutcome), with the head's own states for the drafts. Nothing past the extend is committed.
    ahead: list[int] = field(default_factory=list)
    ahead_parents: list[int] = field(default_factory=list)


DraftOp = ExtendPropose | Release


def pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def extend_bucket(tokens: int) -> int:
    """Tokens a draft cycle's extend is padded to (a power of two): the draft captures a graph per bucket."""
    return pow2_at_least(tokens)


def draft_cycle_entries(last_start: int, longest: int, last_end: int, steps: int, topk: int) -> int:
    """KV entries a draft cycle spans: extends after up to `last_start` committed entries, padded
    to the extend_bucket of the `longest`, ending at up to `last_end`, then `steps` levels of
    `topk` nodes each (the first beside the extend). The draft's graphs are keyed by its bucket."""
    return max(last_start + extend_bucket(longest), last_end + max(0, steps - 1) * topk)


@dataclass
class AheadOutcome:
    """One outcome of a verify that a draft-ahead assumed, and its proposal: the `accepted` drafts
    from the root to ExtendPropose.ahead[node] accepted (node -1: none), then the target's token
    `bonus`."""

    accepted: int
    bonus: int
    draft_ids: list[int] = field(default_factory=list)
    draft_parents: list[int] = field(default_factory=list)
    node: int = -1


@dataclass
class DraftResult:
    seq_id: int
    code: Code = Code.OK
    message: str = ""
    draft_ids: list[int] = field(default_factory=list)
    draft_dists: list[SparseDist] = field(default_factory=list)
    consumed_generation: int = 0
    draft_parents: list[int] = field(default_factory=list)  # a tree (as in Verify); empty: a chain
    ahead: list[AheadOutcome] = field(default_factory=list)  # drafting ahead: the outcomes proposed for
    started_ns: int = 0
    ended_ns: int = 0


@dataclass
class StepTiming:
    compute_ms: float = 0.0
    total_ms: float = 0.0
