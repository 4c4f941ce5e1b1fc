"""The speculation loop. Every cycle batches all active sequences into one draft call
(extend with the last accepted tokens + propose k) and one target call (prefill the
newcomers, verify everyone's drafts, release the finished): gateway.phases. Sequences join
and leave at cycle boundaries, the next free slot going to the client that runs the fewest
(gateway.waiting); tokens go to each request's stream as soon as a cycle accepts them.

Faults: a draft call that fails or misses its deadline suspends speculation (sequences go on
target-only, tokens unchanged) until the draft is attached again under a new epoch; then each
sequence's features are recomputed by the target (Recapture) and the draft resumes from
position 0. A failed target call, or a target the liveness watch lost, ends every stream with
UNAVAILABLE and marks the target down until it is reachable again. A sequence whose client
leaves more than `stream_buffer` tokens unread waits, and ends after `unread_timeout_s`.

Threads: the loop may run on an event loop of its own thread (the gateway's default, so
that a step's round trip meets no client work), while the servicers call `submit` and
`cancel` from the server's loop. `submit` only appends to the waiting queue; `cancel` and
every other change of state run on the loop's own thread; a sequence's events go to the
loop its submitter runs on."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import grpc
from opentelemetry import trace

from gateway.adaptive import StepChooser
from gateway.clients import DraftClient, TargetClient
from gateway.observe import NOOP_METRICS, CycleSpans, GatewayMetrics, record_finish
from gateway.outbox import Outbox
from gateway.phases import DraftDeadline, draft_phase, target_phase
from gateway.sequence import (
    Failed,
    Finished,
    GenerationRequest,
    Limits,
    LoopTotals,
    QueueFull,
    SeqStats,
    Sequence,
    Unavailable,
    first_sequence_id,
)
from gateway.waiting import WaitingQueue
from specsplit.forced import ForcedAcceptance
from specsplit.observability.spans import SpanLog

log = logging.getLogger("specsplit.gateway")
__all__ = ["Failed", "Finished", "GenerationRequest", "Limits", "QueueFull", "Scheduler", "SeqStats", "Sequence",
           "Unavailable"]
TARGET_LOST = "target service unavailable"
READER_CHECK_S = 0.5


class Scheduler:
    def __init__(self, target: TargetClient, draft: DraftClient | None, max_sequences: int,
                 limits: Limits | None = None, spans: SpanLog | None = None,
                 metrics: GatewayMetrics = NOOP_METRICS, max_steps: int = 8) -> None:  # spans: None untraced
        self.target, self.draft = target, draft
        self.metrics = metrics
        self.limits = limits = limits or Limits()
        self.max_sequences, self.step_timeout_s = max_sequences, limits.step_timeout_s
        self.waiting = WaitingQueue(limits.max_queue, limits.max_queued_per_client)
        self.running: list[Sequence] = []
        self.ids = itertools.count(first_sequence_id())
        self.wake = asyncio.Event()
        self.target_releases: list[int] = []
        self.target_suspends: list[int] = []
        self.draft_releases: list[int] = []
        self.free_generations: list[int] = []  # ring allocations to reclaim on the next target call
        self.outbox = Outbox()  # the readers' events, sent during the next step call (gateway.outbox)
        self.draft_deadline = DraftDeadline(limits.draft_timeout_s)
        self.task: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop (and thread) the cycles run on
        self.thread_id = 0
        self.spans = CycleSpans(spans)
        self.chooser = StepChooser(max_steps)  # adaptive requests' shape per cycle, from measured costs
        self.cycle_ms: dict[str, float] = {}  # this cycle's draft and verify-only call times
        self.forced: ForcedAcceptance | None = None  # a benchmark mode (specsplit.forced)
        self.cycles, self.cycle_decoded = 0, 1  # and the tokens each verify of this cycle decodes (phases.decode_ahead)
        self.totals = LoopTotals()
        self.in_cycle = False
        self.draft_down = True  # until the draft is attached (draft_restored)
        self.target_down = False
        self.closing = ""  # why no more requests are admitted ('' while serving)
        self.on_target_state: list[Callable[[bool], None]] = []

    @property
    def speculating(self) -> bool:
        return self.draft is not None and not self.draft_down

    def start(self) -> None:
        self.loop, self.thread_id = asyncio.get_running_loop(), threading.get_ident()
        self.task = asyncio.create_task(self._run(), name="speculation-loop")

    def _on_loop(self, fn: Callable[..., None], *args: object) -> None:
        """Run fn on the loop's thread: now when called there (or before start), else soon
        (never, once that loop is closed)."""
        if self.loop is None or self.thread_id == threading.get_ident():
            fn(*args)
        else:
            with contextlib.suppress(RuntimeError):  # that loop has closed: the gateway is stopping
                self.loop.call_soon_threadsafe(fn, *args)

    def _post(self, seq: Sequence, event: list[int] | Finished | Failed) -> None:
        """To the sequence's reader: within a cycle while the next step call computes, else now."""
        self.outbox.post(seq, event, now=not self.in_cycle)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def submit(self, req: GenerationRequest, span: trace.Span | None = None) -> Sequence:
        if self.closing:
            raise Unavailable(self.closing)
        if self.target_down:
            raise Unavailable(TARGET_LOST)
        # a request that will take a free KV slot at the next cycle does not wait for one: with the loop on
        # its own thread, several can be submitted before it admits the first
        free = max(self.max_sequences - len(self.running), 0)
        seq = Sequence(next(self.ids), req, span)
        self.waiting.push(seq, free)
        seq.span.add_event("queued", {"spec.seq_id": seq.seq_id, "spec.queue_depth": len(self.waiting)})
        self._on_loop(self.wake.set)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Ends a sequence: at once if it is still waiting, else at the next cycle boundary."""
        if not seq.done:
            self._on_loop(self._cancel, seq)

    def taken(self, seq: Sequence, n: int) -> None:
        """The stream's handler took `n` tokens (its thread): a sequence waiting on its reader goes on."""
        seq.taken += n
        if seq.unread_since:
            self._on_loop(self.wake.set)

    def _cancel(self, seq: Sequence) -> None:
        if seq.done:
            return
        if self.waiting.remove(seq):  # not running: nothing to release but a suspended sequence
            self._retire(seq)
            self._post(seq, Finished("abort"))
            return
        seq.cancelled = True
        self.wake.set()

    # -- service state, driven by the loop's failures, the liveness watch and the recovery task
    def service_lost(self, service: str, why: str) -> None:
        """The liveness watch lost `service` (any thread): its step in flight, if any, is cut
        short, and the service is failed on the loop's thread."""
        client = self.target if service == "target" else self.draft
        interrupt = getattr(client, "interrupt", None)
        if interrupt is not None:
            interrupt()
        self._on_loop(self.target_failed if service == "target" else self.draft_failed, why)

    def draft_failed(self, why: str) -> None:
        if not self.draft_down:
            log.warning("draft unavailable (%s): speculation suspended, streams continue target-only", why)
        self.draft_down = True
        for s in self.running:
            s.synced, s.drafts, s.dists = False, [], []
            if s.pending is not None:
                self.free_generations += [ref.generation for ref in s.pending[1]]
                s.pending = None

    def draft_restored(self) -> None:
        """The draft is attached again under a new epoch (its old state released there): it is
        resynced per sequence."""
        self.draft_down = False
        self.draft_deadline.seen.clear()  # perhaps a new process: its graphs are captured again
        log.info("draft attached: speculation resumes")
        self.wake.set()

    def target_failed(self, why: str) -> None:
        if self.target_down:
            return
        waiting = self.waiting.take_all()
        log.error("target unavailable (%s): ending %d streams", why, len(self.running) + len(waiting))
        for seq in [*self.running, *waiting]:
            self.fail(seq, grpc.StatusCode.UNAVAILABLE, TARGET_LOST)  # the why stays in the log
        self.target_releases.clear()  # the target is taken over by a new epoch: everything is released there
        self.target_suspends.clear()
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
        return bool(self.waiting or self.runnable or self.target_releases or self.target_suspends
                    or self.draft_releases or self.free_generations)

    @property
    def runnable(self) -> list[Sequence]:
        return [s for s in self.running if not s.unread_since or s.cancelled]

    # -- shutting down
    async def drain(self, why: str, grace_s: float) -> None:
        """Admit no more requests; let those in flight finish for up to `grace_s`, then end
        them with UNAVAILABLE; return once their state is released in the services."""
        self.closing = why
        for seq in self.waiting.take_all():
            self.fail(seq, grpc.StatusCode.UNAVAILABLE, why)
        deadline = time.monotonic() + grace_s
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for seq in list(self.running):
            self.fail(seq, grpc.StatusCode.UNAVAILABLE, why)
        deadline = time.monotonic() + 2.0
        while self.busy and not self.target_down and time.monotonic() < deadline:
            self.wake.set()
            await asyncio.sleep(0.01)

    # -- the loop
    async def _run(self) -> None:
        while True:
            if not self.busy:
                self.outbox.deliver()
                self.wake.clear()
                if not self.running:
                    await self.wake.wait()
                    continue
                with contextlib.suppress(TimeoutError):  # sequences wait on their readers: look again soon
                    async with asyncio.timeout(READER_CHECK_S):
                        await self.wake.wait()
                self._check_readers()
                continue
            self.in_cycle = True
            try:
                await self._cycle()
            except Exception as e:  # the target is gone or broken
                log.exception("target call failed")
                self.target_failed(f"{type(e).__name__}: {e}")
                self.outbox.deliver()  # every stream ends now
            finally:
                self.in_cycle = False
                if not self.outbox.delivered:  # no call this cycle: nothing waits for the next one
                    self.outbox.deliver()
            # let the rest of the event loop run between cycles even when the clients never suspend
            # (the in-process LocalTarget/LocalDraft): submissions, cancels, recovery callbacks
            await asyncio.sleep(0)

    async def _cycle(self) -> None:
        self.outbox.cycle_started()
        self._check_readers()
        for seq in [s for s in self.running if s.cancelled]:
            self.finish(seq, Finished("abort"))
        newcomers = self._admit()
        t0, batch = time.perf_counter(), len(self.running)
        traced = self.spans.open(self.running, newcomers)
        self.cycle_ms, self.cycle_decoded = {}, 1
        try:
            await draft_phase(self)
            if not self.target_down:
                await target_phase(self, newcomers)
        finally:
            self.spans.close(traced, self.outbox)
        ms = (time.perf_counter() - t0) * 1e3
        if batch > len(newcomers):
            self.outbox.later(self.metrics.cycle_duration.record, ms)
        self.chooser.settle(ms)
        if set(self.cycle_ms) in ({"draft", "verify"}, {"verify"}):  # the rest of a cycle: host work, transport
            rest = max(ms - sum(self.cycle_ms.values()), 0.0) / self.cycle_decoded  # a token's
            self.chooser.costs.record_rest(batch, rest, "draft" in self.cycle_ms)
        self.cycles += 1

    def _admit(self) -> list[Sequence]:
        """Free slots to waiting requests, fairly; with none free, a slot of the client running
        the most is taken back for a client running at least two fewer (see _preempt)."""
        newcomers: list[Sequence] = []
        while self.waiting:  # cancel() takes waiting ones out itself
            running = Counter(s.req.client for s in self.running)
            if len(self.running) >= self.max_sequences and not self._preempt(running):
                break
            seq = self.waiting.pop_fair(Counter(s.req.client for s in self.running))
            if seq is None:
                break
            self.running.append(seq)
            newcomers.append(seq)
            seq.span.add_event("admitted", {"spec.seq_id": seq.seq_id, "spec.resumed": seq.suspended,
                                            "spec.wait_ms": (time.perf_counter() - seq.submitted_at) * 1e3})
        return newcomers

    def _preempt(self, running: Counter[str]) -> bool:
        """Suspend the youngest sequence of the client running the most, when the next waiting
        request's client runs at least two fewer: its KV slot goes to that request, and it waits
        at the head of its client's queue to be resumed (the target keeps its tokens and sampler;
        its KV entries are prefilled again). True when a slot was freed."""
        nxt = self.waiting.peek_fair(running)
        if nxt is None or not running:
            return False
        client, most = running.most_common(1)[0]
        if most < running[nxt.req.client] + 2:
            return False
        victims = [s for s in self.running if s.req.client == client and s.prefilled and not s.cancelled]
        if not victims:
            return False
        s = max(victims, key=lambda v: v.submitted_at)
        self.running.remove(s)
        s.suspended = True
        self.target_suspends.append(s.seq_id)  # before the next target call's prefills: they take the slot
        if s.in_draft and not self.draft_down:  # resumed from position 0 there
            self.draft_releases.append(s.seq_id)
            s.in_draft = False
        if s.pending is not None:
            self.free_generations += [ref.generation for ref in s.pending[1]]
            s.pending = None
        s.synced, s.drafts, s.dists, s.parents = False, [], [], []
        self.waiting.push_front(s)
        s.span.add_event("suspended", {"spec.seq_id": s.seq_id, "spec.for_client": nxt.req.client})
        log.info("sequence %d suspended for another client (its client runs %d, the other %d)", s.seq_id, most,
                 running[nxt.req.client])
        return True

    def _check_readers(self) -> None:
        """Sequences whose client leaves its stream unread wait (keeping their slot), and end
        when it stays unread too long."""
        now = time.monotonic()
        for s in list(self.running):
            if s.unread <= self.limits.stream_buffer:
                s.unread_since = 0.0
            elif not s.unread_since:
                s.unread_since = now
            elif now - s.unread_since > self.limits.unread_timeout_s:
                self.fail(s, grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the stream was not read for {self.limits.unread_timeout_s:g} s")

    # -- how sequences end
    def emit(self, s: Sequence, tokens: list[int]) -> None:
        out = list(tokens)  # the usual cycle: no stop token, below the length
        end: Finished | None = None
        if len(s.generated) + len(tokens) >= s.req.max_new_tokens or not s.req.stop_ids.isdisjoint(tokens):
            out = []
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
            self.finish(s, end)

    def _retire(self, s: Sequence) -> None:
        s.done = True
        if s.suspended and not self.target_down:  # the target still holds its tokens
            self.target_releases.append(s.seq_id)
        if s in self.running:
            self.running.remove(s)
            if (s.prefilled or s.prompt_done) and not self.target_down:  # (halfway through its prompt too)
                self.target_releases.append(s.seq_id)
            if s.in_draft and not self.draft_down:  # a draft that is down is taken over by a new epoch
                self.draft_releases.append(s.seq_id)
        if s.pending is not None:
            if not self.target_down:
                self.free_generations += [ref.generation for ref in s.pending[1]]
            s.pending = None
        self.wake.set()

    def finish(self, s: Sequence, end: Finished) -> None:
        self._retire(s)
        self.outbox.later(record_finish, s, end, self.metrics, time.perf_counter())
        self._post(s, end)

    def fail(self, s: Sequence, code: grpc.StatusCode, message: str) -> None:
        self._retire(s)
        self._post(s, Failed(code, message))
