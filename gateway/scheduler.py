"""The speculation loop. Every cycle batches all active sequences into one draft call
(extend with the last accepted tokens + propose k) and one target call (prefill the
newcomers, verify everyone's drafts, release the finished). Sequences join and leave at
cycle boundaries; tokens go to each request's queue as soon as a cycle accepts them.

Faults: a failed draft call suspends speculation (sequences go on target-only, tokens
unchanged) until the draft is attached again; then each sequence's features are
recomputed by the target (Recapture) and the draft resumes from position 0. A failed
target call ends every stream with UNAVAILABLE and marks the target down until it is
reachable again.

Threads: the loop may run on an event loop of its own thread (the gateway's default, so
that a step's round trip meets no client work), while the servicers call `submit` and
`cancel` from the server's loop. `submit` only appends to the waiting queue; `cancel` and
every other change of state run on the loop's own thread; a sequence's events go to the
loop its submitter runs on."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import grpc
from opentelemetry import trace

from gateway.clients import DraftClient, TargetClient
from gateway.observe import NOOP_METRICS, NOOP_TRACER, CycleSpans, GatewayMetrics
from gateway.sequence import (
    Failed,
    Finished,
    GenerationRequest,
    LoopTotals,
    QueueFull,
    SeqStats,
    Sequence,
    Unavailable,
)
from specsplit.ops import (
    Code,
    DraftOp,
    DraftResult,
    ExtendPropose,
    Prefill,
    Recapture,
    Release,
    TargetOp,
    TargetResult,
    Verify,
)

log = logging.getLogger("specsplit.gateway")
MAX_DRAFT_FAILURES = 3  # consecutive per-sequence draft errors before the sequence goes on target-only
__all__ = ["Failed", "Finished", "GenerationRequest", "QueueFull", "Scheduler", "SeqStats", "Sequence", "Unavailable"]


class Scheduler:
    def __init__(self, target: TargetClient, draft: DraftClient | None, max_sequences: int, max_queue: int,
                 tracer: trace.Tracer = NOOP_TRACER, metrics: GatewayMetrics = NOOP_METRICS,
                 step_timeout_s: float = 60.0) -> None:
        self.target, self.draft = target, draft
        self.tracer, self.metrics = tracer, metrics
        self.max_sequences, self.max_queue, self.step_timeout_s = max_sequences, max_queue, step_timeout_s
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.ids = itertools.count(1)
        self.wake = asyncio.Event()
        self.target_releases: list[int] = []
        self.draft_releases: list[int] = []
        self.draft_orphans: list[int] = []  # finished while the draft was down
        self.free_generations: list[int] = []  # ring allocations to reclaim on the next target call
        self.task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop (and thread) the cycles run on
        self.thread_id = 0
        self.spans = CycleSpans(tracer)
        self.cycles = 0
        self.totals = LoopTotals()
        self.in_cycle = False
        self.draft_down = True  # until the draft is attached (draft_restored)
        self.target_down = False
        self.on_target_state: list = []  # callbacks(up: bool)

    @property
    def speculating(self) -> bool:
        return self.draft is not None and not self.draft_down

    def start(self) -> None:
        self.loop, self.thread_id = asyncio.get_running_loop(), threading.get_ident()
        self.task = asyncio.create_task(self._run(), name="speculation-loop")

    def _on_loop(self, fn: Callable[..., None], *args: object) -> None:
        """Run fn on the loop's thread: now when called there (or before start), else soon."""
        if self.loop is None or self.thread_id == threading.get_ident():
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    @staticmethod
    def _post(seq: Sequence, event: list[int] | Finished | Failed) -> None:
        """Hand an event to the sequence's reader, on the reader's loop."""
        loop = seq.loop
        if loop is None or loop is asyncio._get_running_loop():
            seq.events.put_nowait(event)
        else:
            loop.call_soon_threadsafe(seq.events.put_nowait, event)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def submit(self, req: GenerationRequest, span: trace.Span | None = None) -> Sequence:
        if self.target_down:
            raise Unavailable("target service unavailable")
        # a request that will take a free KV slot at the next cycle does not wait for one: with the loop on
        # its own thread, several can be submitted before it admits the first
        free = max(self.max_sequences - len(self.running), 0)
        if len(self.waiting) >= self.max_queue + free:
            raise QueueFull(f"{len(self.waiting) - free} requests already waiting")
        seq = Sequence(next(self.ids), req, span)
        seq.span.add_event("queued", {"spec.seq_id": seq.seq_id, "spec.queue_depth": len(self.waiting)})
        self.waiting.append(seq)  # a deque: safe beside the loop thread's popleft; cancel runs on that thread
        self._on_loop(self.wake.set)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Ends a sequence: at once if it is still waiting, else at the next cycle boundary."""
        if not seq.done:
            self._on_loop(self._cancel, seq)

    def _cancel(self, seq: Sequence) -> None:
        if seq.done:
            return
        if seq in self.waiting:  # never admitted: nothing to release anywhere
            self.waiting.remove(seq)
            seq.done = True
            self._post(seq, Finished("abort"))
            return
        seq.cancelled = True
        self.wake.set()

    # -- service state, driven by the loop's failures and by the recovery task
    def draft_failed(self, why: str) -> None:
        if not self.draft_down:
            log.warning("draft unavailable (%s): speculation suspended, streams continue target-only", why)
        self.draft_down = True
        for s in self.running:
            s.synced, s.drafts, s.dists = False, [], []
            if s.pending is not None:
                self.free_generations.append(s.pending[1].generation)
                s.pending = None

    def draft_restored(self) -> None:
        """The draft is attached again (maybe a new process): it will be resynced per sequence."""
        self.draft_down = False
        self.draft_releases += self.draft_orphans  # harmless for a new process, needed for the same one
        self.draft_orphans = []
        log.info("draft attached: speculation resumes")
        self.wake.set()

    def target_failed(self, why: str) -> None:
        log.error("target unavailable (%s): ending %d streams", why, len(self.running) + len(self.waiting))
        for seq in [*self.running, *self.waiting]:
            self._fail(seq, grpc.StatusCode.UNAVAILABLE, f"target service unavailable: {why}")
        self.waiting.clear()
        self.target_releases.clear()  # the next target is a new process: nothing to release there
        self.free_generations.clear()
        self.target_down = True
        for cb in self.on_target_state:
            cb(False)

    def target_restored(self) -> None:
        self.target_down = False
        log.info("target reachable again")
        for cb in self.on_target_state:
            cb(True)
        self.wake.set()

    @property
    def busy(self) -> bool:
        """Work the loop can do now (with the target down, only releases for the draft)."""
        if self.in_cycle:
            return True
        if self.target_down:
            return bool(self.draft_releases)
        return bool(self.waiting or self.running or self.target_releases or self.draft_releases
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
            except Exception as e:  # the target is gone or broken
                log.exception("target call failed")
                self.target_failed(f"{type(e).__name__}: {e}")
            finally:
                self.in_cycle = False
            # let the rest of the event loop run between cycles even when the clients never suspend
            # (the in-process LocalTarget/LocalDraft): submissions, cancels, recovery callbacks
            await asyncio.sleep(0)

    async def _cycle(self) -> None:
        for seq in [s for s in self.running if s.cancelled]:
            self._finish(seq, Finished("abort"))
        newcomers = []
        while self.waiting and len(self.running) < self.max_sequences:  # cancel() takes waiting ones out itself
            seq = self.waiting[0]  # counted as running before it leaves the queue: submit() reads both meanwhile
            self.running.append(seq)
            self.waiting.popleft()
            newcomers.append(seq)
            seq.span.add_event("admitted", {"spec.seq_id": seq.seq_id,
                                            "spec.wait_ms": (time.perf_counter() - seq.submitted_at) * 1e3})
        t0, batch = time.perf_counter(), len(self.running)
        traced = self.spans.open(self.running, newcomers)
        try:
            await self._draft_phase()
            if not self.target_down:
                await self._target_phase(newcomers)
        finally:
            self.spans.close(traced)
        if batch > len(newcomers):
            self.metrics.cycle_duration.record((time.perf_counter() - t0) * 1e3)
        self.cycles += 1

    async def _draft_phase(self) -> None:
        if self.draft is None or self.draft_down:
            self.draft_releases = []  # a draft that comes back is resynced from position 0
            return
        ops: list[DraftOp] = [Release(i) for i in self.draft_releases]
        self.draft_releases = []
        users = [s for s in self.running if s.spec and s.pending is not None]
        for s in users:
            tokens, ref, position = s.pending  # type: ignore[misc]
            ops.append(ExtendPropose(s.seq_id, tokens, ref, s.req.num_steps, s.req.sampling, s.trace, position,
                                     s.req.topk, s.req.num_draft_tokens))
            s.in_draft = True
            self.free_generations.append(ref.generation)  # read before the draft replies: reclaim whatever happens
            s.pending = None
        if not ops:
            return
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.step_timeout_s):  # not wait_for: no task per call, and on 3.11
                results, timing = await self.draft.step(ops)  # wait_for can swallow a cancel (hangs stop())
        except Exception as e:
            self.draft_failed(f"{type(e).__name__}: {e}")
            return
        ms = (time.perf_counter() - t0) * 1e3
        by_id: dict[int, DraftResult] = {r.seq_id: r for r in results}
        for s in users:
            r = by_id.get(s.seq_id)
            if r is None or r.code != Code.OK:
                s.draft_failures += 1
                why = r.message if r else "no result"
                if s.draft_failures >= MAX_DRAFT_FAILURES:  # the same failure again and again: stop asking
                    log.warning("draft failed sequence %d %d times in a row (%s): target-only from here", s.seq_id,
                                s.draft_failures, why)
                    s.spec = False
                else:
                    log.warning("draft failed sequence %d (%s): resyncing it", s.seq_id, why)
                s.synced = False
                continue
            s.synced, s.draft_failures = True, 0
            s.drafts, s.dists, s.parents = r.draft_ids, r.draft_dists, r.draft_parents
            s.cycle_span.set_attributes({"spec.draft_call_ms": ms, "spec.draft_batch_ms": timing.compute_ms})
            s.stats.draft_ms += ms
            s.stats.draft_compute_ms += timing.compute_ms

    async def _target_phase(self, newcomers: list[Sequence]) -> None:
        ops: list[TargetOp] = [Release(i) for i in self.target_releases]
        self.target_releases = []
        releases, self.free_generations = self.free_generations, []
        work: list[Sequence] = []
        speculating = self.speculating
        for s in self.running:
            if s in newcomers:
                ops.append(Prefill(s.seq_id, s.req.prompt_ids, s.req.sampling, capture=s.spec and speculating,
                                   trace=s.trace))
            elif not s.prefilled:
                continue
            elif s.spec and speculating and not s.synced and s.pending is None:
                ops.append(Recapture(s.seq_id, s.trace))  # resync a draft that lost this sequence
            else:
                drafts = s.drafts if s.spec and s.synced and speculating else []
                s.sent_drafts = len(drafts)
                capture = s.spec and s.synced and speculating
                ops.append(Verify(s.seq_id, drafts, s.dists if drafts else [], s.parents if drafts else [],
                                  capture=capture, trace=s.trace))
            work.append(s)
        if not ops and not releases:
            return
        t0 = time.perf_counter()
        async with asyncio.timeout(self.step_timeout_s):
            results, timing = await self.target.step(ops, releases)
        ms = (time.perf_counter() - t0) * 1e3
        by_id: dict[int, TargetResult] = {r.seq_id: r for r in results}
        kinds = {op.seq_id: op for op in ops if not isinstance(op, Release)}
        for s in work:
            self._apply(s, by_id.get(s.seq_id), kinds[s.seq_id], ms, timing.compute_ms)

    def _apply(self, s: Sequence, r: TargetResult | None, op: TargetOp, ms: float, compute_ms: float) -> None:
        if r is None:
            self._fail(s, grpc.StatusCode.INTERNAL, "target returned no result for the sequence")
            return
        if r.code == Code.RESOURCE_EXHAUSTED:  # no slot or ring space: state unchanged, retry
            if isinstance(op, Prefill):
                self.running.remove(s)
                self.waiting.appendleft(s)
            elif isinstance(op, Recapture):  # no scratch slot: go on target-only rather than stall
                log.info("sequence %d cannot be resynced now (%s): target-only from here", s.seq_id, r.message)
                s.spec = False
            return
        if r.code != Code.OK:
            status = grpc.StatusCode.INVALID_ARGUMENT if r.code == Code.INVALID_ARGUMENT else grpc.StatusCode.INTERNAL
            self._fail(s, status, r.message)
            return
        if isinstance(op, Recapture):  # the draft restarts this sequence from position 0
            s.pending = (r.tokens, r.hidden, 0) if r.hidden is not None else None
            s.synced = r.hidden is not None
            return
        start = s.committed
        s.committed = len(op.prompt_ids) if isinstance(op, Prefill) else s.committed + len(r.tokens)
        if r.hidden is not None:
            if s.spec and self.speculating:
                tokens = (s.req.prompt_ids[1:] + r.tokens) if isinstance(op, Prefill) else r.tokens
                s.pending = (tokens, r.hidden, start)
                s.synced = s.synced or isinstance(op, Prefill)
            else:
                self.free_generations.append(r.hidden.generation)
        if isinstance(op, Verify):  # a verify cycle (the prefill's first token is not a cycle)
            s.stats.record_verify(len(r.tokens), ms, compute_ms, s.sent_drafts, r.num_accepted)
            self.totals.record_verify(len(r.tokens), s.sent_drafts, r.num_accepted)
            self.metrics.accepted_length.record(len(r.tokens))
            s.cycle_span.set_attributes({"spec.draft_tokens": s.sent_drafts, "spec.accepted_length": len(r.tokens),
                                         "spec.num_accepted": r.num_accepted, "spec.bonus_token": r.tokens[-1],
                                         "spec.verify_call_ms": ms, "spec.verify_batch_ms": compute_ms})
        else:
            s.prefilled = True
            s.stats.first_token_at = time.perf_counter()
            self.metrics.time_to_first_token.record(s.stats.first_token_at - s.submitted_at)
            s.span.add_event("first_token")
        s.drafts, s.dists, s.parents = [], [], []
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
        self.totals.output_tokens += len(out)
        if out:
            self._post(s, out)
        if end is not None:
            self._finish(s, end)

    def _retire(self, s: Sequence) -> None:
        s.done = True
        if s in self.running:
            self.running.remove(s)
            if s.prefilled and not self.target_down:
                self.target_releases.append(s.seq_id)
            if s.in_draft:  # while the draft is down, kept until it is back (it may be the same process)
                (self.draft_orphans if self.draft_down else self.draft_releases).append(s.seq_id)
        if s.pending is not None:
            if not self.target_down:
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
        self._post(s, end)

    def _fail(self, s: Sequence, code: grpc.StatusCode, message: str) -> None:
        self._retire(s)
        self._post(s, Failed(code, message))
