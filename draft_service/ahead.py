"""Drafting ahead: the next cycle's proposals, made while the target verifies this one.

An ExtendPropose with `ahead` (greedy sequences only) first extends its tokens, which the
verify has confirmed (committed as any extend; there may be none). `ahead` holds the drafts the
target is verifying now, a chain or a tree (`ahead_parents`). The head runs over them level by
level, its own pre-norm states standing in for the target's features (as a proposal's later
steps do), which gives its view of the verify's outcomes: the drafts from the root to a node
accepted (or none), then the target's token there, one the verify did not try. For each node
and the root its two most likely such tokens are candidates. The drafts' best path accepted
with the head's best guess after it runs in the sequence's own slot; the other candidates,
most likely first across the step by the head's own probability of the whole outcome, each in
a scratch slot while free slots last. A slot's entries are the sequence's, then the outcome's
accepted drafts in a row. Each outcome runs its guessed token
and grows the op's chain or tree from there. Nothing past the extend is committed: the next
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


def check_ahead(op: ExtendPropose, seq: DraftSequence | None, max_steps: int, max_nodes: int) -> None:
    """An op that drafts ahead: OpError (INVALID_ARGUMENT) unless it can."""
    if not (op.sampling if seq is None else seq.sampling).greedy:
        raise OpError(Code.INVALID_ARGUMENT, "drafting ahead is for greedy sequences only")
    parents = parents_of(op)
    if len(parents) != len(op.ahead) or any(not -1 <= p < i for i, p in enumerate(parents)):
        raise OpError(Code.INVALID_ARGUMENT, "ahead_parents must give each ahead draft an earlier parent or -1")
    depths = _depths(parents)
    if any(a > b for a, b in zip(depths, depths[1:], strict=False)):  # each level a run: a forward a level
        raise OpError(Code.INVALID_ARGUMENT, "ahead drafts must come level by level, as a proposal's do")
    depth = max(depths, default=0)
    if not 1 <= op.num_steps <= max_steps or depth > max_steps or len(op.ahead) > max_nodes:
        raise OpError(Code.INVALID_ARGUMENT, f"drafting ahead of {len(op.ahead)} drafts {depth} deep by {op.num_steps} "
                                             f"steps: at most {max_nodes} drafts, each depth within 1..{max_steps}")
    if not op.tokens and (seq is None or not seq.length or op.position != seq.length):
        raise OpError(Code.INVALID_ARGUMENT, f"sequence {op.seq_id} has nothing extended to draft ahead from")


def keep_last(engine: DraftEngine, prenorm: torch.Tensor, slots: list[int]) -> None:
    """The pre-norm states [n, H] of the slots' last committed entries: where drafting ahead starts."""
    engine.last_hidden[torch.tensor(slots, device=engine.device)] = prenorm.to(engine.last_hidden.dtype)


@dataclass
class _Outcome:
    entry: int  # index into the step's work
    node: int  # the last accepted draft's index in op.ahead (-1: none)
    path: list[int]  # the accepted drafts' indices, root first
    guess: int  # target id
    hidden: torch.Tensor  # [H] the head's state after the node
    score: float  # the head's log-probability of the outcome
    slot: int = -1


GUESSES = 2  # tokens guessed after each node (or the root)


def draft_ahead(engine: DraftEngine, work: list[Work], ring: torch.Tensor | None, out: list[Proposal]) -> None:
    """Extend and draft ahead for every entry of `work` (each with `op.ahead`), into `out`."""
    runner = engine.runner
    extending = [w for w in work if w.op.tokens]
    if extending:
        rows = [Row(w.seq.slot, w.seq.length, w.op.tokens) for w in extending]
        extended = runner.run(Step(rows, hidden=[w.read(ring) for w in extending]))
        keep_last(engine, torch.stack([prenorm[-1] for _, prenorm in extended]),  # type: ignore[index]
                  [w.seq.slot for w in extending])
        for w in extending:
            w.seq.length += len(w.op.tokens)
    # an entry without room for its drafts and a guess past the committed entries (the context's end) gets none
    live = [j for j, w in enumerate(work) if w.seq.length + len(w.op.ahead) + 1 <= engine.max_context]
    if not live:
        return
    states = _states(engine, work, live)
    scratch: list[int] = []
    try:
        outcomes = _place(engine, work, _candidates(engine, work, live, states), scratch)
        rows = [Row(o.slot, work[o.entry].seq.length + len(o.path), [o.guess]) for o in outcomes]
        guessed = runner.run(Step(rows, hidden=[o.hidden[None] for o in outcomes]))
        logits = torch.stack([step_logits[0] for step_logits, _ in guessed])  # [N, Vd]
        hidden = torch.stack([prenorm[0] for _, prenorm in guessed])  # type: ignore[index]  # [N, H]
        shapes = {i: work[o.entry].greedy_shape for i, o in enumerate(outcomes)}
        grown = engine.grow(shapes, logits, hidden, [r.start + 1 for r in rows],  # type: ignore[arg-type]
                            [o.slot for o in outcomes])
        for i, o in enumerate(outcomes):
            ids, parents = grown[i]
            out[o.entry].ahead.append(AheadOutcome(len(o.path), o.guess, ids,
                                                   parents if work[o.entry].op.topk > 1 else [], o.node))
    finally:
        for slot in scratch:
            runner.release(slot)


def parents_of(op: ExtendPropose) -> list[int]:
    """The ahead drafts' parents (a chain: each the one before)."""
    return op.ahead_parents or list(range(-1, len(op.ahead) - 1))


def _states(engine: DraftEngine, work: list[Work], live: list[int]) -> dict[int, dict[int, tuple[torch.Tensor,
                                                                                                 torch.Tensor]]]:
    """The head's (logits [Vd], pre-norm state [H]) after each node of each live entry's drafts
    (-1: the committed state). Level by level, each a tree forward over the levels so far (in
    creation order, a level's nodes follow the level above), in the sequence's own slot."""
    head = engine.head
    hidden = engine.last_hidden[torch.tensor([work[j].seq.slot for j in live], device=engine.device)]  # [n, H]
    logits = head.lm_head(head.norm(hidden)).float()  # [n, Vd]
    states = {j: {-1: (logits[i], hidden[i])} for i, j in enumerate(live)}
    depths = {j: _depths(parents_of(work[j].op)) for j in live}
    for level in range(1, max(max(depths[j], default=0) for j in live) + 1):
        on = [j for j in live if max(depths[j], default=0) >= level]
        rows, inputs = [], []
        for j in on:
            w, parents = work[j], parents_of(work[j].op)
            n = sum(d <= level for d in depths[j])  # the nodes up to this level: a prefix
            rows.append(Row(w.seq.slot, w.seq.length, w.op.ahead[:n], parents[:n]))
            inputs.append(torch.stack([states[j][parents[i]][1] for i in range(n)]))  # each its parent's state
        for j, (step_logits, prenorm) in zip(on, engine.runner.run(Step(rows, hidden=inputs)), strict=True):
            for i, d in enumerate(depths[j]):
                if d == level:
                    states[j][i] = (step_logits[i], prenorm[i])  # type: ignore[index]
    return states


def _depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def _candidates(engine: DraftEngine, work: list[Work], live: list[int],
                states: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]) -> list[_Outcome]:
    """Every live entry's candidate outcomes: first its drafts' best path (a chain whole, in a
    tree the first child at every depth) accepted with the head's best guess after it, then the
    others, most likely first (by the head's probabilities)."""
    head, table = engine.head, _draft_ids(engine)
    out, first = [], []
    for j in live:
        op = work[j].op
        parents = parents_of(op)
        tried: dict[int, set[int]] = {v: set() for v in range(-1, len(parents))}  # what the verify tries after v
        for c, p in enumerate(parents):
            tried[p].add(op.ahead[c])
        # every node's (and the root's) log-probabilities of the next token, read back at once: its best tokens,
        # and the log-probability of each draft after its parent
        lp = torch.log_softmax(torch.stack([states[j][v][0] for v in range(-1, len(parents))]).float(), dim=-1)
        top = lp.topk(max(map(len, tried.values())) + GUESSES)  # [n + 1, K]
        at = [table.get(t, 0) for t in op.ahead]
        rows = torch.tensor([p + 1 for p in parents], dtype=torch.long, device=lp.device)
        own = lp[rows, torch.tensor(at, dtype=torch.long, device=lp.device)]
        values, ids, own_lp = top.values.tolist(), head.to_target_ids(top.indices).tolist(), own.tolist()
        prefix: dict[int, tuple[float, list[int]]] = {-1: (0.0, [])}  # each node's log-probability and path
        for v in range(-1, len(parents)):  # parents before children
            if v >= 0:  # (a draft outside the draft vocabulary: never the head's)
                before, path = prefix[parents[v]]
                prefix[v] = (before + own_lp[v] if op.ahead[v] in table else float("-inf"), [*path, v])
            score, path = prefix[v]
            guesses = [(g, t) for g, t in zip(values[v + 1], ids[v + 1], strict=True) if t not in tried[v]]
            out += [_Outcome(j, v, path, t, states[j][v][1], score + g) for g, t in guesses[:GUESSES]]
        end = -1  # the best path's last node
        while (nxt := next((c for c, p in enumerate(parents) if p == end), None)) is not None:
            end = nxt
        best = next(o for o in out if o.entry == j and o.node == end)  # its best guess
        out.remove(best)
        first.append(best)
    return first + sorted(out, key=lambda o: -o.score)


def _place(engine: DraftEngine, work: list[Work], candidates: list[_Outcome], scratch: list[int]) -> list[_Outcome]:
    """Slots for the candidates: each entry's first in its own, the next each in a free one
    (taken into `scratch`) while they last. A slot's entries: the sequence's, then the
    outcome's accepted drafts in a row (moved from where the tree forward wrote them)."""
    cache, runner = engine.runner.cache, engine.runner
    placed, own = [], set()
    for o in candidates:
        if o.entry not in own:
            own.add(o.entry)
            o.slot = work[o.entry].seq.slot
        elif runner.free_slots:
            o.slot = runner.allocate()
            scratch.append(o.slot)
        else:
            continue
        placed.append(o)
    for o in sorted(placed, key=lambda o: o.slot == work[o.entry].seq.slot):  # (own slots last: moved in place)
        src, start = work[o.entry].seq.slot, work[o.entry].seq.length
        for kv in (cache.k, cache.v):  # [layers, slots, entries, kv_heads, head_dim]
            if o.slot != src:
                kv[:, o.slot, :start] = kv[:, src, :start]
            for d, node in enumerate(o.path):  # node >= d: a move never overwrites a later source
                kv[:, o.slot, start + d] = kv[:, src, start + node]
    return placed


def _draft_ids(engine: DraftEngine) -> dict[int, int]:
    """Target id -> draft-vocabulary id, for the tokens the head can propose (made once)."""
    table: dict[int, int] | None = getattr(engine, "_ahead_draft_ids", None)
    if table is None:
        ids = engine.head.to_target_ids(torch.arange(engine.head.cfg.draft_vocab_size, device=engine.device))
        table = {t: i for i, t in enumerate(ids.tolist())}
        engine._ahead_draft_ids = table  # type: ignore[attr-defined]
    return table
