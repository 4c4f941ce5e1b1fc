"""Drafting ahead: the next cycle's proposal, made while the target verifies this one.

An ExtendPropose with `ahead` drafts (greedy sequences only) first extends its tokens, which
the verify has confirmed (committed as any extend; there may be none), then assumes the
drafts the target is verifying now are accepted: it runs the head over them one token a step,
its own pre-norm state standing in for the target's features (as a proposal's later steps
do), guesses the target's token after them, runs that token too, and grows the op's chain or
tree from there. Nothing past the extend is committed: the next extend, from the committed
length, overwrites those entries whatever the verify decided.

The gateway keeps the proposal when the verify accepts exactly the assumed drafts and the
guessed token (a hit), and drops it otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specsplit.ops import Code, ExtendPropose, OpError
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


def draft_ahead(engine: DraftEngine, work: list[Work], ring: torch.Tensor | None, out: list[Proposal]) -> None:
    """Extend and draft ahead for every entry of `work` (each with `op.ahead`), into `out`."""
    runner = engine.runner
    extending = [w for w in work if w.op.tokens]
    if extending:
        rows = [Row(w.seq.slot, w.seq.length, w.op.tokens) for w in extending]
        extended = runner.run(Step(rows, hidden=[w.read(ring) for w in extending]))
        last = torch.stack([prenorm[-1] for _, prenorm in extended])  # type: ignore[index]  # [n, H]
        engine.keep_last(last, [w.seq.slot for w in extending])
        for w in extending:
            w.seq.length += len(w.op.tokens)
    # the assumed drafts, then the guessed token, one token a step; an entry without room for them
    # past the committed entries (the context's end) gets no proposal
    live = [j for j, w in enumerate(work) if w.seq.length + len(w.op.ahead) + 1 <= engine.max_context]
    if not live:
        return
    hidden = engine.last_hidden[torch.tensor([work[j].seq.slot for j in live], device=engine.device)]  # [n, H]
    logits: torch.Tensor | None = None
    bonus: dict[int, int] = {}
    for step in range(max(len(work[j].op.ahead) for j in live) + 1):
        tokens = []
        for i, j in enumerate(live):
            path = work[j].op.ahead
            if step < len(path):
                tokens.append(path[step])
                continue
            if step == len(path):  # the verify's token after the assumed drafts, as the head sees it
                assert logits is not None
                bonus[j] = int(engine.head.to_target_ids(logits[i].argmax()))
            tokens.append(bonus[j])
        rows = [Row(work[j].seq.slot, work[j].seq.length + step, [t]) for j, t in zip(live, tokens, strict=True)]
        stepped = runner.run(Step(rows, hidden=[hidden[i][None] for i in range(len(live))]))
        logits = torch.stack([step_logits[0] for step_logits, _ in stepped])  # [n, Vd]
        hidden = torch.stack([prenorm[0] for _, prenorm in stepped])  # type: ignore[index]  # [n, H]
        done = [i for i, j in enumerate(live) if step == len(work[j].op.ahead)]
        if done:
            _grow_from([work[live[i]] for i in done], logits[done], hidden[done], engine,
                       [out[live[i]] for i in done])
            for i in done:
                out[live[i]].bonus = bonus[live[i]]
            keep = [i for i in range(len(live)) if i not in done]
            live = [live[i] for i in keep]
            if not live:
                return
            logits, hidden = logits[keep], hidden[keep]


def _grow_from(work: list[Work], logits: torch.Tensor, hidden: torch.Tensor, engine: DraftEngine,
               out: list[Proposal]) -> None:
    """Grow each entry's chain or tree after its assumed drafts and guessed token."""
    shapes = {i: w.greedy_shape for i, w in enumerate(work)}
    ends = [w.seq.length + len(w.op.ahead) + 1 for w in work]
    grown = engine.grow(shapes, logits, hidden, ends, [w.seq.slot for w in work])  # type: ignore[arg-type]
    for i, (ids, parents) in grown.items():
        out[i].ids = ids
        if shapes[i][0] > 1:  # type: ignore[index]
            out[i].parents = parents
