"""Drafting ahead (gateway.phases' target call): while the target verifies a cycle's drafts, the
draft proposes the next cycle's for outcomes of that verify: the drafts from the root to a node
accepted (or none), then the target's token there as the head guesses it (draft_service.ahead).

The call goes out before the target's and its reply is read after it, so the two services
compute at once. The same draft call extends the sequence by the tokens the last verify
confirmed, with the target's features (the extend a hit put off). When the verify's tokens are
one of the outcomes proposed for (a hit), the next cycle verifies that outcome's proposal at
once, without a draft call before it; otherwise (a miss) the proposals are dropped and the
next cycle drafts as usual. The draft commits nothing past its extend, and
the target decides every token: the output is the same either way. Greedy sequences only (a
sampled proposal would draw from the draft's generator for a path that may not happen)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.sequence import Sequence
from specsplit.ops import Code, DraftResult, ExtendPropose, HiddenRef, TargetOp, Verify

if TYPE_CHECKING:
    from gateway.scheduler import Scheduler

log = logging.getLogger("specsplit.gateway")
MAX_AHEAD_FAILURES = 3  # as gateway.phases' MAX_DRAFT_FAILURES


def accepted_tokens(drafts: list[int], parents: list[int], node: int) -> list[int]:
    """The drafts from the root to drafts[node] (-1: none); a chain (no parents): the first node + 1."""
    if not parents:
        return drafts[: node + 1]
    path = []
    while node >= 0:
        path.append(drafts[node])
        node = parents[node]
    return path[::-1]


@dataclass
class Ahead:
    """A cycle's draft-ahead call in flight."""

    ops: list[ExtendPropose] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    sent: object = None  # the draft client's handle (send's return)
    deadline: float = 0.0
    results: dict[int, DraftResult] = field(default_factory=dict)
    wait_ms: float = 0.0  # how long the reply was waited for after the target's


def plan(sched: Scheduler, ops: list[TargetOp], work: list[Sequence]) -> Ahead:
    """The ops of this cycle's draft-ahead call: one for each greedy sequence whose verify
    carries drafts and captures their features."""
    ahead = Ahead()
    if not sched.limits.draft_ahead or not sched.speculating:
        return ahead
    verifies = {op.seq_id: op for op in ops if type(op) is Verify}
    for s in work:
        op = verifies.get(s.seq_id)
        if op is None or not op.draft_ids or not op.capture or not s.req.sampling.greedy or not s.shape.steps:
            continue
        if s.pending is not None:  # the extend a hit put off (its features freed by the next target call: this
            tokens, refs, position = s.pending  # one's releases are taken)
            hidden, earlier = refs[-1], refs[:-1]
            sched.free_generations += [ref.generation for ref in refs]
            s.pending = None
        else:
            tokens, hidden, earlier, position = [], HiddenRef(0, 0, 0), [], s.committed
        ahead.ops.append(ExtendPropose(s.seq_id, tokens, hidden, s.shape.steps, s.req.sampling, s.trace, position,
                                       s.shape.topk, s.shape.tokens, earlier, op.draft_ids, op.draft_parents))
        ahead.seqs.append(s)
        s.in_draft = True
    if ahead.ops:
        shape = ("ahead", *sched.draft_deadline.shape(ahead.ops))  # type: ignore[arg-type]
        ahead.deadline = sched.draft_deadline.seconds(ahead.ops, shape)  # type: ignore[arg-type]
        sched.draft_deadline.seen.add(shape)
    return ahead


async def send(sched: Scheduler, ahead: Ahead) -> None:
    if not ahead.ops:
        return
    try:
        ahead.sent = await sched.draft.send(ahead.ops)  # type: ignore[union-attr]
    except Exception as e:  # noqa: BLE001 - any failure of the call suspends speculation
        sched.draft_failed(f"{type(e).__name__}: {e}")


async def receive(sched: Scheduler, ahead: Ahead) -> None:
    """The reply, after the target's (a failure suspends speculation, as a draft call's does)."""
    if ahead.sent is None:
        return
    t0 = time.perf_counter()
    try:
        results, _ = await sched.draft.receive(ahead.sent, ahead.deadline)  # type: ignore[union-attr]
    except TimeoutError:
        sched.draft_failed(f"a step took longer than its deadline of {ahead.deadline * 1e3:.0f} ms")
        return
    except Exception as e:  # noqa: BLE001
        sched.draft_failed(f"{type(e).__name__}: {e}")
        return
    finally:
        ahead.sent = None
        ahead.wait_ms = (time.perf_counter() - t0) * 1e3
    ahead.results = {r.seq_id: r for r in results}


def settle(sched: Scheduler, ahead: Ahead, verified: dict[int, list[int]]) -> None:
    """After the verify's results moved each sequence on: a hit's proposal becomes the next
    cycle's drafts; a sequence the draft failed is resynced. `verified`: each sequence's
    tokens from the target (accepted drafts, then its own)."""
    for s, op in zip(ahead.seqs, ahead.ops, strict=True):
        r = ahead.results.get(s.seq_id)
        if s.done or not sched.speculating or not s.spec:
            continue
        if r is None or r.code != Code.OK:
            s.draft_failures += 1
            log.warning("draft failed sequence %d ahead (%s): resyncing it", s.seq_id, r.message if r else "no result")
            if s.draft_failures >= MAX_AHEAD_FAILURES:
                s.spec = False
            if s.pending is not None:  # the draft's state is not what the gateway thinks: recapture it all
                sched.free_generations += [ref.generation for ref in s.pending[1]]
                s.pending = None
            s.synced, s.drafts, s.parents = False, [], []
            continue
        s.draft_failures = 0
        tokens = verified.get(s.seq_id)
        hit = next((o for o in r.ahead if o.draft_ids
                    and tokens == [*accepted_tokens(op.ahead, op.ahead_parents, o.node), o.bonus]), None)
        if hit is not None:
            s.drafts, s.dists, s.parents = hit.draft_ids, [], hit.draft_parents
        s.stats.record_ahead(hit is not None)
        sched.totals.record_ahead(hit is not None)
        if s.cycle_span.is_recording():
            s.cycle_span.set_attributes({"spec.draft_ahead": "miss" if hit is None else "hit",
                                         "spec.draft_ahead_outcomes": len(r.ahead),
                                         "spec.draft_ahead_accepted": -1 if hit is None else hit.accepted,
                                         "spec.draft_ahead_wait_ms": ahead.wait_ms})
