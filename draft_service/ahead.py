"""Drafting ahead: the next cycle's proposals, made while the target verifies this one.

An ExtendPropose with `ahead` (greedy sequences only) first extends its tokens, which the
verify has confirmed (committed as any extend; there may be none). `ahead` is the best path of
the drafts the target is verifying now. The head runs over it one token a step, its own
pre-norm state standing in for the target's features (as a proposal's later steps do), which
gives its view of every outcome of the verify:
  - the whole path accepted, then the target's token after it: the head's best guess;
  - the first d drafts accepted (d < len(path)), the target choosing another token than the
    draft at depth d + 1: the head's best token outside its `topk` best there (the ones a
    tree of that branching verifies; a chain's draft itself).
Each outcome runs its guessed token and grows the op's chain or tree from there: the whole
path's in the sequence's slot, the others each in a scratch slot holding a copy of the
sequence's entries up to where that outcome departs from the path (as many as the engine's
free slots allow, the shallowest first). Nothing past the extend is committed: the next
extend, from the committed length, overwrites those entries whatever the verify decided.

The gateway keeps the proposal of the outcome that happened, if any was proposed (a hit),
and drops the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specsplit.ops import AheadOutcome, Code, ExtendPropose, OpError
from specsplit.runner.runner import Row, Step

if TYPE_CHECKING:
    from draft_service.engine import DraftEngine, DraftSequence, Proposal, Work


def check_ahead(op: ExtendPropose, seq: DraftSequence | None, max_steps: int) -> None:
    """An op that drafts ahead: OpError (INVALID_ARGUMENT) unless it can."""
    if not (op.sampling if seq is None else seq.sampling).greedy:
        raise OpError(Code.INVALID_ARGUMENT, "drafting ahead is for greedy sequences only")
    if op.num_steps < 1 or len(op.ahead) > max_steps:
        raise OpError(Code.INVALID_ARGUMENT, f"drafting ahead of {len(op.ahead)} drafts by {op.num_steps} steps: "
                                             f"each must be within 1..{max_steps}")
    if not op.tokens and (seq is None or not seq.length or op.position != seq.length):
        raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} has nothing extended to draft ahead from")


def keep_last(engine: DraftEngine, prenorm: torch.Tensor, slots: list[int]) -> None:
    """The pre-norm states [n, H] of the slots' last committed entries: where drafting ahead starts."""
    engine.last_hidden[torch.tensor(slots, device=engine.device)] = prenorm.to(engine.last_hidden.dtype)


@dataclass
class _Outcome:
    entry: int  # index into the step's work
    accepted: int
    guess: int  # target id
    slot: int
    start: int  # where the guess goes: committed entries + accepted
    hidden: torch.Tensor  # [H] the head's state before it


def draft_ahead(engine: DraftEngine, work: list[Work], ring: torch.Tensor | None, out: list[Proposal]) -> None:
    """Extend and draft ahead for every entry of `work` (each with `op.ahead`), into `out`."""
    runner, head = engine.runner, engine.head
    extending = [w for w in work if w.op.tokens]
    if extending:
        rows = [Row(w.seq.slot, w.seq.length, w.op.tokens) for w in extending]
        extended = runner.run(Step(rows, hidden=[w.read(ring) for w in extending]))
        keep_last(engine, torch.stack([prenorm[-1] for _, prenorm in extended]),  # type: ignore[index]
                  [w.seq.slot for w in extending])
        for w in extending:
            w.seq.length += len(w.op.tokens)
    # an entry without room for its path and a guess past the committed entries (the context's end) gets none
    live = [j for j, w in enumerate(work) if w.seq.length + len(w.op.ahead) + 1 <= engine.max_context]
    if not live:
        return
    # the head's states along each path: states[j][d] is (its logits [Vd], its pre-norm state [H]) before
    # the path's token at depth d + 1 (d = 0: the committed state)
    hidden = engine.last_hidden[torch.tensor([work[j].seq.slot for j in live], device=engine.device)]  # [n, H]
    logits = head.lm_head(head.norm(hidden)).float()  # [n, Vd]
    states: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {j: [(logits[i], hidden[i])]
                                                                   for i, j in enumerate(live)}
    for step in range(max(len(work[j].op.ahead) for j in live)):
        on = [j for j in live if step < len(work[j].op.ahead)]
        rows = [Row(work[j].seq.slot, work[j].seq.length + step, [work[j].op.ahead[step]]) for j in on]
        stepped = runner.run(Step(rows, hidden=[states[j][-1][1][None] for j in on]))
        for j, (step_logits, prenorm) in zip(on, stepped, strict=True):
            states[j].append((step_logits[0], prenorm[0]))  # type: ignore[index]
    scratch: list[int] = []
    try:
        outcomes = _outcomes(engine, work, live, states, scratch)
        rows = [Row(o.slot, o.start, [o.guess]) for o in outcomes]
        guessed = runner.run(Step(rows, hidden=[o.hidden[None] for o in outcomes]))
        logits = torch.stack([step_logits[0] for step_logits, _ in guessed])  # [N, Vd]
        hidden = torch.stack([prenorm[0] for _, prenorm in guessed])  # type: ignore[index]  # [N, H]
        shapes = {i: work[o.entry].greedy_shape for i, o in enumerate(outcomes)}
        grown = engine.grow(shapes, logits, hidden, [o.start + 1 for o in outcomes],  # type: ignore[arg-type]
                            [o.slot for o in outcomes])
        for i, o in enumerate(outcomes):
            ids, parents = grown[i]
            out[o.entry].ahead.append(AheadOutcome(o.accepted, o.guess, ids,
                                                   parents if work[o.entry].op.topk > 1 else []))
    finally:
        for slot in scratch:
            runner.release(slot)


def _outcomes(engine: DraftEngine, work: list[Work], live: list[int],
              states: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], scratch: list[int]) -> list[_Outcome]:
    """Each live entry's outcomes: the whole path first, then departures from it, the shallowest
    first, while free slots last (taken into `scratch`, each filled with its entries)."""
    head, cache = engine.head, engine.runner.cache
    out = []
    for j in live:
        w, path = work[j], work[j].op.ahead
        logits, _ = states[j][len(path)]
        guess = int(head.to_target_ids(logits.argmax()))
        out.append(_Outcome(j, len(path), guess, w.seq.slot, w.seq.length + len(path), states[j][len(path)][1]))
    for j in live:
        w, path = work[j], work[j].op.ahead
        for d in range(len(path)):
            if not engine.runner.free_slots:
                return out
            logits, _ = states[j][d]
            best = logits.topk(w.op.topk + 1).indices[-1]  # past the tokens a verify of this branching tried
            slot = engine.runner.allocate()
            scratch.append(slot)
            end = w.seq.length + d  # the sequence's entries and the path's first d
            cache.k[:, slot, :end] = cache.k[:, w.seq.slot, :end]
            cache.v[:, slot, :end] = cache.v[:, w.seq.slot, :end]
            out.append(_Outcome(j, d, int(head.to_target_ids(best)), slot, end, states[j][d][1]))
    return out
