"""The two halves of a cycle (gateway.scheduler): what the draft call and the target call carry,
and how their replies move each sequence on. Plus the draft's deadline, set from its own
measured step times."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import grpc

from gateway import ahead
from gateway.costs import NO_DRAFT, Shape
from gateway.observe import record_draft, record_verify
from gateway.sequence import Sequence
from specsplit.ops import (
    MAX_EARLIER,
    PUT_OFF_TOKENS,
    Code,
    DraftOp,
    DraftResult,
    ExtendPropose,
    Prefill,
    Recapture,
    Release,
    Resume,
    StepTiming,
    Suspend,
    TargetOp,
    TargetResult,
    Verify,
    draft_cycle_entries,
    extend_bucket,
    pow2_at_least,
)

if TYPE_CHECKING:
    from opentelemetry import trace

    from gateway.observe import CycleSpan
    from gateway.scheduler import Scheduler

log = logging.getLogger("specsplit.gateway")
MAX_DRAFT_FAILURES = 3  # consecutive per-sequence draft errors before the sequence goes on target-only


class DraftDeadline:
    """How long a draft call may take: `factor` times the p99 of its recent cycle steps, at
    least `floor_s`, at most `cap_s`; `cap_s` until enough steps are measured, for calls that
    extend a whole prompt (a newcomer, a resync), and for the first call of each shape (batch,
    depth, branching, extend length, context: on a GPU the draft captures a CUDA graph for it,
    which takes longer than a step). A first call's time is not a step's."""

    def __init__(self, cap_s: float, floor_s: float = 0.05, factor: float = 10.0, window: int = 64,
                 long_tokens: int = 32) -> None:
        self.cap_s, self.floor_s, self.factor, self.long_tokens = cap_s, floor_s, factor, long_tokens
        self.times: deque[float] = deque(maxlen=window)
        self.seen: set[tuple[int, ...]] = set()
        self._p99: float | None = None  # of `times`, made again after every 8 records
        self._records = 0

    def is_long(self, ops: list[DraftOp]) -> bool:
        return max((len(op.tokens) for op in ops if type(op) is ExtendPropose), default=0) > self.long_tokens

    @staticmethod
    def shape(ops: list[DraftOp]) -> tuple[int, ...]:
        """The call's shape as the draft's graphs are keyed (batch, extend and context in buckets)."""
        return DraftDeadline.measure(ops)[0]

    @staticmethod
    def measure(ops: list[DraftOp]) -> tuple[tuple[int, ...], int]:
        """The call's shape and its longest extend, in one pass (the loop's critical path)."""
        n = steps = topk = longest = last_start = last_end = 0
        for op in ops:
            if type(op) is ExtendPropose:
                n, size, start = n + 1, len(op.tokens), op.position
                steps, topk = max(steps, op.num_steps), max(topk, op.topk)
                longest, last_start, last_end = max(longest, size), max(last_start, start), max(last_end, start + size)
        if not n:
            return (), 0
        ctx = draft_cycle_entries(last_start, longest, last_end, steps, topk)
        return (pow2_at_least(n), steps, topk, extend_bucket(longest), max(128, pow2_at_least(ctx))), longest

    def seconds(self, ops: list[DraftOp], shape: tuple[int, ...], long: bool | None = None) -> float:
        """The deadline of a call of `shape` (DraftDeadline.shape(ops)); `long`: is_long(ops),
        where the caller knows it."""
        if shape not in self.seen or len(self.times) < 8 or (self.is_long(ops) if long is None else long):
            return self.cap_s
        if self._p99 is None:
            self._p99 = sorted(self.times)[min(len(self.times) - 1, int(0.99 * len(self.times)))]
        return min(self.cap_s, max(self.floor_s, self.factor * self._p99))

    def record(self, ops: list[DraftOp], shape: tuple[int, ...], seconds: float, long: bool | None = None) -> None:
        """A call's time; `long`: is_long(ops), where the caller knows it."""
        if shape in self.seen and not (self.is_long(ops) if long is None else long):
            self.times.append(seconds)
            self._records += 1
            if self._records % 8 == 0:
                self._p99 = None
        self.seen.add(shape)


def bounded(client: object, seconds: float) -> contextlib.AbstractAsyncContextManager[object]:
    """A step call's timeout: the client's own where it has one (clients.bounded_steps), else
    asyncio.timeout around the call (a context manager each call: microseconds a cycle)."""
    return contextlib.nullcontext() if getattr(client, "bounded_steps", False) else asyncio.timeout(seconds)


async def draft_phase(sched: Scheduler) -> None:
    """Releases, then extend + propose for every sequence with new tokens: one call."""
    if sched.draft is None or sched.draft_down:
        sched.draft_releases = []  # a draft that comes back takes a new epoch: its old state is released there
        return
    ops: list[DraftOp] = [Release(i) for i in sched.draft_releases]
    sched.draft_releases = []
    candidates: list[Sequence] = []
    sleeping: list[Sequence] = []
    for s in sched.running:
        if s.spec and s.prefilled and not s.unread_since:  # (a prompt in parts: extended once whole)
            if s.pending is not None and not s.drafts:  # (drafts already: drafted ahead, extended with the next)
                candidates.append(s)
            if s.dormant:
                sleeping.append(s)
    batch = len(candidates) + len(sleeping)
    adaptive = [s for s in candidates if s.req.adaptive]
    resting: list[Sequence] = []
    if adaptive:
        fixed = [s.shape for s in candidates if not s.req.adaptive and s.shape.steps]
        floor = Shape.covering(fixed) if fixed else None
        for s, choice in zip(adaptive, sched.chooser.choose_batch(adaptive, batch, floor), strict=True):
            s.shape = choice.shape
            if sched.chooser.rests(s, choice):
                resting.append(s)
            if s.cycle_span.is_recording():
                s.cycle_span.set_attributes(choice.attributes())
    if sleeping:
        woken = sched.chooser.wake(sleeping, batch, planned=bool(adaptive))
        for s in sleeping:  # the woken one's features are recomputed in this cycle's target call
            if s.cycle_span.is_recording():
                s.cycle_span.set_attributes({"spec.num_steps": 0, "spec.adaptive": True,
                                             "spec.adaptive.reason": "wake" if s is woken else "dormant"})
    for s in resting:  # dormant: its features are no longer captured, nor its extends made
        sched.free_generations += [ref.generation for ref in s.pending[1]]  # type: ignore[index]
        s.pending, s.synced, s.dormant, s.idle_cycles = None, False, True, 0
        candidates.remove(s)
        adaptive.remove(s)
    # a cycle that drafts nothing for a sequence puts its extend off (for more tokens, or a cycle that
    # drafts); once one of them must extend, all do, in one call
    put_off = [s for s in adaptive if not s.shape.steps]
    flush = any(len(s.pending[0]) >= PUT_OFF_TOKENS or len(s.pending[1]) > MAX_EARLIER  # type: ignore[index]
                for s in put_off)
    users = []
    for s in candidates:
        tokens, refs, position = s.pending  # type: ignore[misc]
        if s.req.adaptive and not s.shape.steps and not flush:
            continue
        ops.append(ExtendPropose(s.seq_id, tokens, refs[-1], s.shape.steps, s.req.sampling, s.trace, position,
                                 s.shape.topk, s.shape.tokens, refs[:-1]))
        users.append(s)
        s.in_draft = True
        # read before the draft replies: reclaim whatever happens
        sched.free_generations += [ref.generation for ref in refs]
        s.pending = None
    if not ops:
        return
    shape, longest = sched.draft_deadline.measure(ops)
    long = longest > sched.draft_deadline.long_tokens
    deadline = sched.draft_deadline.seconds(ops, shape, long)
    sched.cycle_ms["other"] = 0.0  # a call made: until it is priced below, the cycle's rest is no cost of its shape
    t0 = time.perf_counter()
    try:
        async with bounded(sched.draft, deadline):
            results, timing = await sched.draft.step(ops, deadline, meanwhile=sched.outbox.deliver)
    except TimeoutError:
        sched.draft_failed(f"a step took longer than its deadline of {deadline * 1e3:.0f} ms")
        return
    except Exception as e:  # noqa: BLE001 - any failure of the call suspends speculation
        sched.draft_failed(f"{type(e).__name__}: {e}")
        return
    seconds = time.perf_counter() - t0
    first = shape not in sched.draft_deadline.seen  # a call whose graphs were captured: not a cost
    sched.draft_deadline.record(ops, shape, seconds, long)
    ms = seconds * 1e3
    if users and not long and any(s.shape.steps for s in users):  # what's priced
        del sched.cycle_ms["other"]
        sched.cycle_ms["draft"] = ms
        sched.chooser.costs.record_draft(len(users), max(s.shape.family for s in users),
                                         max(s.shape.steps for s in users), ms)
    if first:
        sched.chooser.forgive_probe()
    if long and not first:  # a newcomer's prompt or a resync: what waking a dormant sequence costs the draft
        sched.chooser.costs.record_extend(longest, ms)
    by_id: dict[int, DraftResult] = {r.seq_id: r for r in results}
    drafted: list[tuple[Sequence, trace.Span | CycleSpan]] = []
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
        drafted.append((s, s.cycle_span))
    sched.outbox.later(record_draft, drafted, ms, timing)


async def target_phase(sched: Scheduler, newcomers: list[Sequence]) -> None:
    """Releases, prefills of the newcomers, recaptures and verifies: one call. Prompts are
    prefilled oldest first, up to the limits' prefill_chunk tokens a call: a longer one in parts
    over several calls, while the running sequences go on. A sequence whose client leaves its
    stream unread waits."""
    ops: list[TargetOp] = [*(Release(i) for i in sched.target_releases), *(Suspend(i) for i in sched.target_suspends)]
    sched.target_releases, sched.target_suspends = [], []
    releases, sched.free_generations = sched.free_generations, []
    work: list[Sequence] = []
    sent: list[TargetOp] = []  # work's ops
    speculating = sched.speculating
    prefilled = 0  # tokens prefilled or recomputed: what the chooser prices a dormant sequence's wake from
    budget = sched.limits.prefill_chunk or 1 << 62  # prompt tokens this call (0: no limit)
    for s in sched.running:
        if s in newcomers and s.suspended:
            ops.append(Resume(s.seq_id, capture=s.spec and speculating and not s.dormant, trace=s.trace))
            prefilled += s.committed
        elif not s.prefilled:  # a newcomer's prompt, whole or its next part
            if budget <= 0:
                continue
            start = s.prompt_done
            if not start and s.req.adaptive and s.spec and speculating and sched.chooser.starts_dormant(
                    s, len(sched.running)):
                s.dormant = True  # its features are recomputed if a probe wakes it
                if s.cycle_span.is_recording():
                    s.cycle_span.set_attribute("spec.adaptive.reason", "dormant")
            prompt = s.req.prompt_ids  # in at most MAX_EARLIER + 1 parts: the draft reads their features in one extend
            part = prompt[start : start + max(budget, -(-len(prompt) // (MAX_EARLIER + 1)))]
            budget -= len(part)
            # (a part goes without features once an earlier part's are gone: recaptured when whole)
            capture = s.spec and speculating and not s.dormant and (not start or s.pending is not None)
            ops.append(Prefill(s.seq_id, part, s.req.sampling, capture=capture, trace=s.trace, start=start,
                               more=start + len(part) < len(prompt)))
            prefilled += len(part)
        elif s.unread_since:
            continue
        elif s.spec and speculating and not s.synced and s.pending is None and not s.dormant:
            ops.append(Recapture(s.seq_id, s.trace))  # resync a draft that lost this sequence, or a woken one
            prefilled += s.committed
        else:
            drafts = s.drafts if s.spec and s.synced and speculating else []
            s.sent_drafts = len(drafts)
            capture = s.spec and s.synced and speculating
            forced = -1
            if drafts and sched.forced is not None and s.req.sampling.greedy:
                forced = sched.forced.draw(s.forced_rng, s.shape.steps)
                s.cycle_span.set_attribute("spec.forced_acceptance", forced)
            ops.append(Verify(s.seq_id, drafts, s.dists if drafts else [], s.parents if drafts else [],
                              capture=capture, trace=s.trace, forced=forced))
        work.append(s)
        sent.append(ops[-1])
    if not ops and not releases:
        return
    decoded = decode_ahead(sched, ops, work)
    if decoded > 1:
        for op in ops:
            if type(op) is Verify:
                op.decode = decoded
    sched.cycle_decoded = decoded
    drafting = ahead.plan(sched, ops, work)  # the next cycle's drafts, proposed meanwhile (gateway.ahead)
    await ahead.send(sched, drafting)
    t0 = time.perf_counter()
    try:
        async with bounded(sched.target, sched.step_timeout_s):
            results, timing = await sched.target.step(ops, releases, sched.step_timeout_s,
                                                      meanwhile=sched.outbox.deliver)
    finally:
        ms = (time.perf_counter() - t0) * 1e3
        await ahead.receive(sched, drafting)
    if drafting.ops:
        sched.cycle_ms["ahead"] = drafting.wait_ms  # a cycle of another kind: not priced as one that drafts
    if prefilled:
        sched.chooser.costs.record_prefill(prefilled, ms)
    verifies = [op for op in ops if isinstance(op, Verify)]
    if verifies and len(verifies) == len(work):  # verifies only (no prefill): what the chooser prices
        sched.cycle_ms["verify"] = ms
        rows = max(len(op.draft_ids) + 1 for op in verifies)
        if decoded > 1:
            sched.chooser.costs.record_decode(len(verifies), ms / decoded)  # a token's share
        else:
            sched.chooser.record_verify(len(verifies), rows, ms)
    by_id = {r.seq_id: r for r in results}
    for s, op in zip(work, sent, strict=True):
        apply_result(sched, s, by_id.get(s.seq_id), op, ms, timing)
    if drafting.ops:
        ahead.settle(sched, drafting, {r.seq_id: r.tokens for r in results if r.code == Code.OK})


def decode_ahead(sched: Scheduler, ops: list[TargetOp], work: list[Sequence]) -> int:
    """How many tokens each verify of this target call decodes: where it drafts nothing for
    anyone, captures nothing and prefills nothing, and no waiting request could take a free
    slot at the next cycle, as many as the limits' decode_ahead_ms holds at this batch's
    measured cost of a token (a power of two, at most decode_most and what any sequence has
    left); else one. The target runs them as one step, so a cycle's host work and
    transport are paid once for them."""
    limits = sched.limits
    if limits.decode_ahead_ms <= 0 or limits.decode_most < 2 or not work:
        return 1
    if sched.waiting and len(sched.running) < sched.max_sequences:
        return 1
    verifies = 0
    for op in ops:
        if type(op) is Verify:
            if op.draft_ids or op.capture or op.forced >= 0:
                return 1
            verifies += 1
        elif type(op) is not Release and type(op) is not Suspend:
            return 1
    if verifies != len(work):
        return 1
    token_ms = sched.chooser.costs.token_ms(len(work))
    if not token_ms:
        return 1  # measured first
    left = min(s.req.max_new_tokens - len(s.generated) for s in work)
    most = min(limits.decode_most, left, int(limits.decode_ahead_ms / token_ms))
    return 1 << (most.bit_length() - 1) if most > 1 else 1


def apply_result(sched: Scheduler, s: Sequence, r: TargetResult | None, op: TargetOp, ms: float,
                 timing: StepTiming) -> None:
    """A target result moves its sequence on: tokens emitted, features pending for the draft."""
    if r is None:
        sched.fail(s, grpc.StatusCode.INTERNAL, "target returned no result for the sequence")
        return
    kind = type(op)
    if r.code == Code.RESOURCE_EXHAUSTED:  # no slot or ring space: state unchanged, retry
        if (kind is Prefill and not op.start) or kind is Resume:  # type: ignore[union-attr]
            sched.running.remove(s)
            sched.waiting.push_front(s)
        elif kind is Prefill and s.pending is not None:  # no ring space for a part: its earlier parts' go too,
            sched.free_generations += [ref.generation for ref in s.pending[1]]  # so that prompts in parts never
            s.pending = None  # hold the ring between them; the rest goes without features
        elif kind is Recapture:  # no scratch slot: go on target-only rather than stall
            log.info("sequence %d cannot be resynced now (%s): target-only from here", s.seq_id, r.message)
            s.spec = False
        return
    if r.code != Code.OK:
        status = grpc.StatusCode.INVALID_ARGUMENT if r.code == Code.INVALID_ARGUMENT else grpc.StatusCode.INTERNAL
        sched.fail(s, status, r.message)
        return
    if kind is Recapture or kind is Resume:  # the draft restarts this sequence from position 0
        s.suspended = False
        s.pending = (r.tokens, [r.hidden], 0) if r.hidden is not None else None
        s.synced = r.hidden is not None
        return
    prefill = kind is Prefill  # (the prompt whole, or a part of it)
    start = s.committed
    s.committed = start + len(op.prompt_ids if prefill else r.tokens)  # type: ignore[union-attr]
    if r.hidden is not None:
        # a prompt's features count from its first part on (a part captured after one that was not: none)
        if s.spec and sched.speculating and (not prefill or not start or s.pending is not None):
            # a prompt's position i pairs with the token after it, the next part's first or the generated one
            tokens = (s.req.prompt_ids[start + 1 : s.committed + 1] + r.tokens) if prefill else r.tokens
            if s.pending is not None:  # the extend was put off: these rows follow the ones it holds
                before, refs, at = s.pending
                s.pending = (before + tokens, [*refs, r.hidden], at)
            else:
                s.pending = (tokens, [r.hidden], start)
            s.synced = s.synced or (prefill and not op.more)  # type: ignore[union-attr]
        else:
            sched.free_generations.append(r.hidden.generation)
    elif prefill and s.pending is not None:  # a part without features: the earlier parts' are of no use
        sched.free_generations += [ref.generation for ref in s.pending[1]]
        s.pending = None
    if prefill and op.more:  # type: ignore[union-attr]
        s.prompt_done = s.committed  # the rest of the prompt in later calls; nothing generated yet
        return
    if not prefill:  # a verify cycle (the prefill's first token is not a cycle; a decode of k tokens is k)
        drafted, decoded = s.sent_drafts, op.decode  # type: ignore[union-attr]
        s.stats.cycles += decoded
        if drafted:
            sched.chooser.observe(s, s.shape, r.num_accepted)
        sched.outbox.later(record_verify, s, s.cycle_span, sched.totals, sched.metrics, r, ms, timing, drafted,
                           decoded, s.shape if drafted else NO_DRAFT)
    else:
        s.prefilled = True
        s.stats.first_token_at = time.perf_counter()
        sched.metrics.time_to_first_token.record(s.stats.first_token_at - s.submitted_at)
        s.span.add_event("first_token")
    if s.drafts:
        s.drafts, s.dists, s.parents = [], [], []
    sched.emit(s, r.tokens)
