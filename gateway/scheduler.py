"""The speculation loop. Every cycle batches all active sequences into one draft call
(extend with the last accepted tokens + propose k) and one target call (prefill the
newcomers, verify everyone's drafts, release the finished). Sequences join and leave at
cycle boundaries; tokens go to each request's queue as soon as a cycle accepts them."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from gateway.clients import DraftClient, TargetClient
from gateway.observe import NOOP_METRICS, NOOP_TRACER, GatewayMetrics
from specsplit.ops import (
    Code,
    DraftOp,
    DraftResult,
    ExtendPropose,
    HiddenRef,
    Prefill,
    Release,
    Sampling,
    SparseDist,
    TargetOp,
    TargetResult,
    Verify,
)
from specsplit.telemetry import inject

log = logging.getLogger("specsplit.gateway")


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    stop_ids: set[int]
    num_steps: int  # 0: speculation off (target-only decoding)


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
    first_token_at: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        return sum(k * v for k, v in self.histogram.items()) / self.cycles if self.cycles else 0.0


class Sequence:
    def __init__(self, seq_id: int, req: GenerationRequest, span: trace.Span | None = None) -> None:
        self.seq_id, self.req = seq_id, req
        self.span = span or trace.INVALID_SPAN  # the request span; cycles are its children
        self.cycle_span: trace.Span = trace.INVALID_SPAN
        self.trace = ""  # traceparent of the current cycle span, sent with every op
        self.sent_drafts = 0
        self.events: asyncio.Queue[list[int] | Finished | Failed] = asyncio.Queue()
        self.generated: list[int] = []
        self.spec = req.num_steps > 0  # false for good once the draft fails this sequence
        self.prefilled = False
        self.in_draft = False  # the draft holds state for it
        self.pending: tuple[list[int], HiddenRef] | None = None  # features the draft has not consumed
        self.drafts: list[int] = []
        self.dists: list[SparseDist] = []
        self.stats = SeqStats()
        self.submitted_at = time.perf_counter()
        self.done = False
        self.cancelled = False


class QueueFull(Exception):
    pass


class Scheduler:
    def __init__(self, target: TargetClient, draft: DraftClient | None, max_sequences: int, max_queue: int,
                 tracer: trace.Tracer = NOOP_TRACER, metrics: GatewayMetrics = NOOP_METRICS) -> None:
        self.target, self.draft = target, draft
        self.tracer, self.metrics = tracer, metrics
        self.max_sequences, self.max_queue = max_sequences, max_queue
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.ids = itertools.count(1)
        self.wake = asyncio.Event()
        self.target_releases: list[int] = []
        self.draft_releases: list[int] = []
        self.free_generations: list[int] = []  # ring allocations to reclaim on the next target call
        self.task: asyncio.Task[None] | None = None
        self.cycles = 0
        self.in_cycle = False

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="speculation-loop")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def submit(self, req: GenerationRequest, span: trace.Span | None = None) -> Sequence:
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        seq = Sequence(next(self.ids), req, span)
        seq.span.add_event("queued", {"spec.seq_id": seq.seq_id, "spec.queue_depth": len(self.waiting)})
        self.waiting.append(seq)
        self.wake.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        if not seq.done:
            seq.cancelled = True
            self.wake.set()

    @property
    def busy(self) -> bool:
        return bool(self.in_cycle or self.waiting or self.running or self.target_releases or self.draft_releases
                    or self.free_generations)

    # -- the loop
    async def _run(self) -> None:
        while True:
            if not self.busy:
                self.wake.clear()
                await self.wake.wait()
                continue
            self.in_cycle = True
            try:
                await self._cycle()
            except Exception as e:  # the target is gone or broken: fail every active stream
                log.exception("cycle failed")
                for seq in [*self.running, *self.waiting]:
                    self._fail(seq, grpc.StatusCode.UNAVAILABLE, f"target service unavailable: {e}")
                self.waiting.clear()
                self.target_releases.clear()
                self.free_generations.clear()
                await asyncio.sleep(0.05)
            finally:
                self.in_cycle = False

    async def _cycle(self) -> None:
        for seq in [s for s in self.running if s.cancelled]:
            self._finish(seq, Finished("abort"))
        while self.waiting and self.waiting[0].cancelled:
            self.waiting.popleft().done = True
        newcomers = []
        while self.waiting and len(self.running) < self.max_sequences:
            seq = self.waiting.popleft()
            if not seq.cancelled:
                self.running.append(seq)
                newcomers.append(seq)
                seq.span.add_event("admitted", {"spec.seq_id": seq.seq_id,
                                                "spec.wait_ms": (time.perf_counter() - seq.submitted_at) * 1e3})
        t0 = time.perf_counter()
        traced = list(self.running)
        for s in traced:
            s.cycle_span = self.tracer.start_span(
                "prefill" if s in newcomers else "cycle", context=trace.set_span_in_context(s.span),
                attributes={"spec.cycle": 0 if s in newcomers else s.stats.cycles + 1, "spec.batch_size": len(traced),
                            "spec.num_steps": s.req.num_steps if s.spec else 0, "spec.seq_id": s.seq_id})
            s.trace = inject(s.cycle_span)
        try:
            await self._draft_phase()
            await self._target_phase(newcomers)
        finally:
            for s in traced:
                s.cycle_span.end()
                s.cycle_span, s.trace = trace.INVALID_SPAN, ""
        if len(traced) > len(newcomers):
            self.metrics.cycle_duration.record((time.perf_counter() - t0) * 1e3)
        self.cycles += 1

    async def _draft_phase(self) -> None:
        ops: list[DraftOp] = [Release(i) for i in self.draft_releases]
        self.draft_releases = []
        users = [s for s in self.running if s.spec and s.pending is not None]
        for s in users:
            tokens, ref = s.pending  # type: ignore[misc]
            ops.append(ExtendPropose(s.seq_id, tokens, ref, s.req.num_steps, s.req.sampling, s.trace))
            s.in_draft = True
        if not ops or self.draft is None:
            return
        for s in users:  # rows are read before the draft replies: reclaim them whatever happens
            self.free_generations.append(s.pending[1].generation)  # type: ignore[index]
            s.pending = None
        t0 = time.perf_counter()
        try:
            results, timing = await self.draft.step(ops)
        except Exception as e:
            log.warning("draft call failed (%s); continuing with target-only decoding", e)
            for s in users:
                s.spec = False
            return
        ms = (time.perf_counter() - t0) * 1e3
        by_id: dict[int, DraftResult] = {r.seq_id: r for r in results}
        for s in users:
            r = by_id.get(s.seq_id)
            if r is None or r.code != Code.OK:
                log.warning("draft failed sequence %d: %s", s.seq_id, r.message if r else "no result")
                s.spec = False
                continue
            s.drafts, s.dists = r.draft_ids, r.draft_dists
            s.cycle_span.set_attributes({"spec.draft_call_ms": ms, "spec.draft_batch_ms": timing.compute_ms})
            s.stats.draft_ms += ms
            s.stats.draft_compute_ms += timing.compute_ms

    async def _target_phase(self, newcomers: list[Sequence]) -> None:
        ops: list[TargetOp] = [Release(i) for i in self.target_releases]
        self.target_releases = []
        releases, self.free_generations = self.free_generations, []
        work: list[Sequence] = []
        for s in self.running:
            if s in newcomers:
                ops.append(Prefill(s.seq_id, s.req.prompt_ids, s.req.sampling, capture=s.spec, trace=s.trace))
            elif s.prefilled:
                drafts = s.drafts if s.spec else []
                s.sent_drafts = len(drafts)
                ops.append(Verify(s.seq_id, drafts, s.dists if drafts else [], capture=s.spec, trace=s.trace))
            else:
                continue
            work.append(s)
        if not ops and not releases:
            return
        t0 = time.perf_counter()
        results, timing = await self.target.step(ops, releases)
        ms = (time.perf_counter() - t0) * 1e3
        by_id: dict[int, TargetResult] = {r.seq_id: r for r in results}
        for s in work:
            self._apply(s, by_id.get(s.seq_id), ms, timing.compute_ms)

    def _apply(self, s: Sequence, r: TargetResult | None, ms: float, compute_ms: float) -> None:
        if r is None:
            self._fail(s, grpc.StatusCode.INTERNAL, "target returned no result for the sequence")
            return
        if r.code == Code.RESOURCE_EXHAUSTED:  # no slot or ring space: state unchanged, retry
            if not s.prefilled:
                self.running.remove(s)
                self.waiting.appendleft(s)
            return
        if r.code != Code.OK:
            status = grpc.StatusCode.INVALID_ARGUMENT if r.code == Code.INVALID_ARGUMENT else grpc.StatusCode.INTERNAL
            self._fail(s, status, r.message)
            return
        if r.hidden is not None:
            if s.spec and self.draft is not None:
                tokens = (s.req.prompt_ids[1:] + r.tokens) if not s.prefilled else r.tokens
                s.pending = (tokens, r.hidden)
            else:
                self.free_generations.append(r.hidden.generation)
        if s.prefilled:  # a verify cycle (the prefill's first token is not a cycle)
            s.stats.cycles += 1
            s.stats.histogram[len(r.tokens)] += 1
            s.stats.verify_ms += ms
            s.stats.verify_compute_ms += compute_ms
            self.metrics.accepted_length.record(len(r.tokens))
            s.cycle_span.set_attributes({"spec.draft_tokens": s.sent_drafts, "spec.accepted_length": len(r.tokens),
                                         "spec.num_accepted": r.num_accepted, "spec.bonus_token": r.tokens[-1],
                                         "spec.verify_call_ms": ms, "spec.verify_batch_ms": compute_ms})
        else:
            s.prefilled = True
            s.stats.first_token_at = time.perf_counter()
            self.metrics.time_to_first_token.record(s.stats.first_token_at - s.submitted_at)
            s.span.add_event("first_token")
        s.drafts, s.dists = [], []
        self._emit(s, r.tokens)

    def _emit(self, s: Sequence, tokens: list[int]) -> None:
        out: list[int] = []
        end: Finished | None = None
        for t in tokens:
            if t in s.req.stop_ids:
                end = Finished("stop", t)
                break
            out.append(t)
            if len(s.generated) + len(out) >= s.req.max_new_tokens:
                end = Finished("length")
                break
        s.generated += out
        if out:
            s.events.put_nowait(out)
        if end is not None:
            self._finish(s, end)

    def _retire(self, s: Sequence) -> None:
        s.done = True
        if s in self.running:
            self.running.remove(s)
            if s.prefilled:
                self.target_releases.append(s.seq_id)
            if s.in_draft:
                self.draft_releases.append(s.seq_id)
        if s.pending is not None:
            self.free_generations.append(s.pending[1].generation)
            s.pending = None
        self.wake.set()

    def _finish(self, s: Sequence, end: Finished) -> None:
        self._retire(s)
        now, n = time.perf_counter(), len(s.generated)
        self.metrics.output_tokens.add(n)
        if n > 1 and s.stats.first_token_at:
            self.metrics.time_per_output_token.record((now - s.stats.first_token_at) / (n - 1))
        if n:
            self.metrics.tokens_per_second.record(n / max(now - s.submitted_at, 1e-9))
        s.span.add_event("finished", {"gen_ai.response.finish_reason": end.reason, "spec.cycles": s.stats.cycles})
        s.events.put_nowait(end)

    def _fail(self, s: Sequence, code: grpc.StatusCode, message: str) -> None:
        self._retire(s)
        s.events.put_nowait(Failed(code, message))
