"""A request as the speculation loop holds it: what was asked, its state between cycles, its
statistics, and the events its stream reads; and the loop's limits."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from gateway.costs import DepthAcceptance, Shape
from specsplit.ops import HiddenRef, Sampling, SparseDist, StepTiming

if TYPE_CHECKING:
    from gateway.observe import CycleSpan


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    stop_ids: set[int]
    num_steps: int  # 0: speculation off (target-only decoding); a tree's depth
    topk: int = 1  # > 1: a tree of drafts (greedy only)
    num_draft_tokens: int = 0  # a tree's size counting the root; a chain: num_steps + 1 (0 means that)
    client: str = ""  # who asked (gateway.stream.client_key): the unit of fairness and of per-client limits
    adaptive: bool = False  # the shape is chosen per cycle (gateway.adaptive); num_steps etc. are the first cycles'
    min_steps: int = 0  # the fewest steps an adaptive cycle drafts (1: speculation was asked for)

    def __post_init__(self) -> None:
        if self.topk == 1:
            self.num_draft_tokens = self.num_steps + 1 if self.num_steps else 0


@dataclass
class Finished:
    reason: str  # "stop", "length", "abort"
    matched_stop: int | None = None


@dataclass
class Failed:
    code: grpc.StatusCode
    message: str


@dataclass
class SeqStats:
    cycles: int = 0
    histogram: Counter[int] = field(default_factory=Counter)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    draft_compute_ms: float = 0.0
    verify_compute_ms: float = 0.0
    draft_service_ms: float = 0.0  # the services' whole handling of the calls (StepTiming.total_ms)
    verify_service_ms: float = 0.0
    first_token_at: float = 0.0
    draft_tokens: int = 0  # draft tokens sent to verify
    accepted_drafts: int = 0  # of those, accepted
    shapes: Counter[Shape] = field(default_factory=Counter)  # verify cycles by what they drafted
    ahead_hits: int = 0  # drafted ahead (gateway.ahead), and the verify's outcome was the one assumed
    ahead_misses: int = 0

    def record_ahead(self, hit: bool) -> None:
        self.ahead_hits += hit
        self.ahead_misses += not hit

    @property
    def steps_histogram(self) -> list[int]:
        """Index i: verify cycles that drafted i steps."""
        out = [0] * (max((sh.steps for sh in self.shapes), default=-1) + 1)
        for sh, n in self.shapes.items():
            out[sh.steps] += n
        return out

    @property
    def mean_accepted_length(self) -> float:
        return sum(k * v for k, v in self.histogram.items()) / self.cycles if self.cycles else 0.0

    def record_verify(self, emitted: int, ms: float, timing: StepTiming, drafts: int, accepted: int,
                      shape: Shape, decoded: int = 1) -> None:
        """One verify call; `decoded` > 1: a decode of that many tokens, counted as that many
        cycles of one token (`cycles` is counted as the reply comes: the loop reads it)."""
        self.shapes[shape] += decoded
        self.histogram[emitted // decoded] += decoded
        self.verify_ms += ms
        self.verify_compute_ms += timing.compute_ms
        self.verify_service_ms += timing.total_ms
        self.draft_tokens += drafts
        self.accepted_drafts += accepted


@dataclass
class LoopTotals:
    """Counts since the gateway started (the SGLang GetLoads report reads them)."""

    verify_cycles: int = 0
    verify_tokens: int = 0  # tokens emitted by verifies, bonus included: verify_tokens / verify_cycles is tau
    draft_tokens: int = 0
    accepted_drafts: int = 0
    output_tokens: int = 0
    ahead_hits: int = 0
    ahead_misses: int = 0

    def record_ahead(self, hit: bool) -> None:
        self.ahead_hits += hit
        self.ahead_misses += not hit

    def record_verify(self, emitted: int, drafts: int, accepted: int, decoded: int = 1) -> None:
        self.verify_cycles += decoded  # a decode of several tokens: a cycle of one token each
        self.verify_tokens += emitted
        self.draft_tokens += drafts
        self.accepted_drafts += accepted


class Sequence:
    def __init__(self, seq_id: int, req: GenerationRequest, span: trace.Span | None = None) -> None:
        self.seq_id, self.req = seq_id, req
        self.span = span or trace.INVALID_SPAN  # the request span; cycles are its children
        self.cycle_span: trace.Span | CycleSpan = trace.INVALID_SPAN
        self.trace = ""  # traceparent of the current cycle span, sent with every op
        ctx = self.span.get_span_context()  # a sampled request's trace id, span id and traceparent's head
        self.trace_ids = (ctx.trace_id, ctx.span_id, f"00-{ctx.trace_id:032x}-") if ctx.trace_flags.sampled else None
        self.sent_drafts = 0
        self.events: asyncio.Queue[list[int] | Finished | Failed] = asyncio.Queue()
        self.generated: list[int] = []
        self.spec = req.num_steps > 0  # speculation asked for
        self.synced = False  # the draft holds this sequence's state up to the target's
        self.prefilled = False  # the target has its whole prompt (and sent its first token)
        self.prompt_done = 0  # prompt tokens the target holds while it has them in parts
        self.committed = 0  # positions in the target's KV cache
        self.in_draft = False  # the draft may hold state for it
        # (tokens, their feature rows, position) not extended yet: more than one reference after cycles
        # that drafted nothing (the draft's extend is put off, gateway.phases)
        self.pending: tuple[list[int], list[HiddenRef], int] | None = None
        self.drafts: list[int] = []
        self.dists: list[SparseDist] = []
        self.parents: list[int] = []  # a tree's shape (empty: a chain)
        self.shape = Shape.of(req)  # what this cycle drafts (an adaptive request: chosen per cycle)
        self.acceptance: dict[tuple[int, int], DepthAcceptance] = {}  # an adaptive request's own, per family
        self.draft_failures = 0  # in a row
        # an adaptive request whose plan drafted nothing for a while lets the draft's state go: the
        # target captures no features for it and the draft extends nothing, until a probe wakes it
        # (gateway.adaptive: DORMANT_AFTER, StepChooser.wake)
        self.dormant = False
        self.idle_cycles = 0  # cycles in a row its plan drafted nothing
        self.wake_probe = False  # woken: its first cycle with features drafts past its plan
        self.forced_rng = random.Random(seq_id)  # forced acceptance's draws (a benchmark mode)
        self.stats = SeqStats()
        self.submitted_at = time.perf_counter()
        self.done = False
        self.cancelled = False
        # tokens handed to the stream (by the loop) and taken by its handler: the difference is
        # what a client that does not read leaves waiting
        self.posted = self.taken = 0
        self.unread_since = 0.0  # when the sequence stopped for an unread stream (0: it did not)
        self.suspended = False  # its KV slot given to another client's request: resumed when admitted again
        try:  # where the submitter reads `events`
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None

    @property
    def unread(self) -> int:
        return self.posted - self.taken


@dataclass
class Limits:
    max_queue: int = 256  # requests waiting for a slot, in all
    max_queued_per_client: int = 64
    step_timeout_s: float = 30.0  # a target step slower than this fails the target
    draft_timeout_s: float = 5.0  # the longest a draft step may take (see DraftDeadline)
    stream_buffer: int = 1024  # tokens a client may leave unread before its sequence waits
    unread_timeout_s: float = 30.0  # a sequence waiting on its reader this long ends
    # a cycle that drafts nothing for anyone, no newcomer due, decodes as many tokens a call as take this long
    # (at most decode_most); 0: one token a call
    decode_ahead_ms: float = 0.0
    decode_most: int = 1  # the target's limit (its max_draft_tokens + 1)
    prefill_chunk: int = 0  # prompt tokens a target call prefills, over all its prompts; 0: every prompt whole
    draft_ahead: bool = False  # greedy sequences' next drafts proposed while the target verifies (gateway.ahead)


def first_sequence_id() -> int:
    """Sequence ids of one gateway start above every id of an earlier start (by the clock)."""
    return (time.time_ns() // 1_000_000) << 20


class QueueFull(Exception):
    pass


class Unavailable(Exception):
    pass
