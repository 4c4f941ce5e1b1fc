"""Drafting ahead: the next cycle's proposals, made while the target verifies this one.

An ExtendPropose with `ahead` (greedy sequences only) first extends its tokens, which the
verify has confirmed (committed as any extend; there may be none). `ahead` is the best path of
the drafts the target is verifying now. The head runs over it one token a step, its own
pre-norm state standing in for the target's features (as a proposal's later steps do), which
gives its view of the verify's outcomes (the path's first d drafts accepted, then the target's
token):
  - after the whole path, its best and second best guesses;
  - where the path departs at depth d + 1, its two best tokens outside its `topk` best there
    (the ones a tree of that branching verifies; a chain's draft itself).
Each outcome runs its guessed token and grows the op's chain or tree from there: the whole path
with its best guess in the sequence's slot, the others, most likely first by the head's own
probabilities across the step, each in a scratch slot holding a copy of the sequence's entries
up to where it departs, while free slots last. Nothing past the extend is committed: the next
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


GUESSES = 2  # tokens guessed where an outcome departs from the path, or after the whole path


def _outcomes(engine: DraftEngine, work: list[Work], live: list[int],
              states: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], scratch: list[int]) -> list[_Outcome]:
    """Each live entry's outcomes: the whole path with the head's best guess after it, in the
    sequence's slot; then, while free slots last (taken into `scratch`, each filled with its
    entries), the others most likely by the head's own probabilities (the path's first d drafts,
    then a guess: its second best after the whole path, or its best outside the `topk` a verify
    tried at depth d + 1), across the step's entries."""
    head, cache = engine.head, engine.runner.cache
    out, others = [], []
    for j in live:
        w, path = work[j], work[j].op.ahead
        prefix = 0.0  # log-probability of the path's first d drafts, as the head sees them
        for d in range(len(path) + 1):
            logits, hidden = states[j][d]
            lp = torch.log_softmax(logits.float(), dim=-1)
            skip = w.op.topk if d < len(path) else 0
            top = lp.topk(skip + GUESSES)
            scores, ids = top.values[skip:].tolist(), head.to_target_ids(top.indices[skip:]).tolist()
            for rank, (score, guess) in enumerate(zip(scores, ids, strict=True)):
                if d == len(path) and rank == 0:
                    out.append(_Outcome(j, d, guess, w.seq.slot, w.seq.length + d, hidden))
                elif d == len(path) or guess != path[d]:
                    others.append((prefix + score, j, d, guess))
            if d < len(path):
                at = _draft_ids(engine).get(path[d])  # (a path token outside the draft vocabulary: never accepted)
                prefix += float(lp[at]) if at is not None else float("-inf")
    for _, j, d, guess in sorted(others, key=lambda c: -c[0]):
        if not engine.runner.free_slots:
            break
        w = work[j]
        slot = engine.runner.allocate()
        scratch.append(slot)
        end = w.seq.length + d  # the sequence's entries and the path's first d
        cache.k[:, slot, :end] = cache.k[:, w.seq.slot, :end]
        cache.v[:, slot, :end] = cache.v[:, w.seq.slot, :end]
        out.append(_Outcome(j, d, guess, slot, end, states[j][d][1]))
    return out


def _draft_ids(engine: DraftEngine) -> dict[int, int]:
    """Target id -> draft-vocabulary id, for the tokens the head can propose (made once)."""
    table: dict[int, int] | None = getattr(engine, "_ahead_draft_ids", None)
    if table is None:
        ids = engine.head.to_target_ids(torch.arange(engine.head.cfg.draft_vocab_size, device=engine.device))
        table = {t: i for i, t in enumerate(ids.tolist())}
        engine._ahead_draft_ids = table  # type: ignore[attr-defined]
    return table
