"""Drafting ahead: the next cycle's proposals, made while the target verifies this one.

An ExtendPropose with `ahead` (greedy sequences only) first extends its tokens, which the
verify has confirmed (committed as any extend; there may be none). `ahead` holds the drafts the
target is verifying now, a chain or a tree (`ahead_parents`). The head runs over them as a tree
(a forward per level, every node each time: a node's input is its parent's pre-norm state from
the forward before), its own states standing in for the target's features (as a proposal's
later steps do), which gives its view of the verify's outcomes: the drafts from the root to a
node accepted (or none), then the target's token there, one the verify did not try. For each
node and the root its two most likely such tokens are candidates. The drafts' best path (a
chain whole, in a tree the first child at every depth) accepted with the head's best guess
after it runs in the sequence's own slot; the other candidates, most likely first across the
step by the head's own probability of the whole outcome, each in a scratch slot while they
last (the draft's --ahead-slots, shared by the call's sequences). A slot's entries are the
sequence's, then the outcome's accepted drafts in a row. Each outcome runs its guessed token
and grows the op's chain or tree from there. Nothing past the extend is committed: the next
extend, from the committed length, overwrites those entries whatever the verify decided.

All of it, for every entry of one topk, is one function of static shapes (one CUDA graph per
shape): the integers go to the device in one copy and the outcomes come back in one read.

The gateway keeps the proposal of the outcome that happened, if any was proposed (a hit),
and drops the others.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch

from draft_service.tree import tree_result
from specsplit.models.batch import tree_ancestry
from specsplit.ops import AheadOutcome, Code, ExtendPropose, OpError, extend_bucket
from specsplit.runner.runner import Row, Step, padded_rows

if TYPE_CHECKING:
    from draft_service.engine import DraftEngine, DraftSequence, Proposal, Work

GUESSES = 2  # tokens guessed after each node (or the root)
_HEAD = 7  # an entry's integers before its tokens: slot, last row, count, start, base, valid, own slot


def check_ahead(op: ExtendPropose, seq: DraftSequence | None, max_steps: int, max_nodes: int) -> None:
    """An op that drafts ahead: OpError (INVALID_ARGUMENT) unless it can."""
    if not (op.sampling if seq is None else seq.sampling).greedy:
        raise OpError(Code.INVALID_ARGUMENT, "drafting ahead is for greedy sequences only")
    parents = parents_of(op)
    if len(parents) != len(op.ahead) or any(not -1 <= p < i for i, p in enumerate(parents)):
        raise OpError(Code.INVALID_ARGUMENT, "ahead_parents must give each ahead draft an earlier parent or -1")
    depths = _depths(tuple(parents))
    if any(a > b for a, b in zip(depths, depths[1:], strict=False)):  # each level a run, as a proposal's
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


def parents_of(op: ExtendPropose) -> list[int]:
    """The ahead drafts' parents (a chain: each the one before)."""
    return op.ahead_parents or list(range(-1, len(op.ahead) - 1))


@functools.lru_cache(maxsize=1024)
def _depths(parents: tuple[int, ...]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


@functools.lru_cache(maxsize=1024)
def _tree(parents: tuple[int, ...], a: int, d: int) -> np.ndarray:
    """One entry's tree integers for A = a nodes and D = d levels (the batch's, the entry's own
    padded with nodes under the root that no outcome uses): parents [A], node in use [A], each
    row's depth [A + 1] and path of nodes, root first [A + 1, D] (row 0: the root, row v + 1:
    node v), the ancestry mask [A, A], and the row of the best path's end."""
    n = len(parents)
    depth = [0, *_depths(parents)] + [1] * (a - n)
    paths = np.zeros((a + 1, d), dtype=np.int64)
    for v, p in enumerate(parents):
        paths[v + 1] = paths[p + 1]
        paths[v + 1, depth[v + 1] - 1] = v
    mask, _ = tree_ancestry((*parents, *[-1] * (a - n)), a)
    end = -1  # the best path's last node: the first child at every depth
    while (nxt := next((c for c, p in enumerate(parents) if p == end), None)) is not None:
        end = nxt
    return np.concatenate([np.array([*parents, *[-1] * (a - n)]), np.arange(a) < n, depth, paths.ravel(),
                           mask.ravel().astype(np.int64), [end + 1]]).astype(np.int64)


def draft_ahead(engine: DraftEngine, work: list[Work], ring: torch.Tensor | None, out: list[Proposal]) -> None:
    """Extend and draft ahead for every entry of `work` (each with `op.ahead`), into `out`: one
    static function per topk."""
    runner = engine.runner
    # extends the padded step does not take (restarts from entry 0, long parts) run first, as any extend
    apart = [w for w in work if w.op.tokens and (w.seq.length == 0 or len(w.op.tokens) > runner.padded_tokens)]
    if apart:
        extended = runner.run(Step([Row(w.seq.slot, w.seq.length, w.op.tokens) for w in apart],
                                   hidden=[w.read(ring) for w in apart]))
        keep_last(engine, torch.stack([prenorm[-1] for _, prenorm in extended]),  # type: ignore[index]
                  [w.seq.slot for w in apart])
    for topk in sorted({w.op.topk for w in work}):
        group = [j for j, w in enumerate(work) if w.op.topk == topk]
        _draft_ahead(engine, [work[j] for j in group], [w in apart for w in (work[j] for j in group)], ring,
                     [out[j] for j in group])


def _draft_ahead(engine: DraftEngine, work: list[Work], done: list[bool], ring: torch.Tensor | None,
                 out: list[Proposal]) -> None:
    r, head = engine.runner, engine.head
    new = [[] if d else w.op.tokens for w, d in zip(work, done, strict=True)]  # each entry's extend in the step
    starts = [w.seq.length for w in work]
    for w in work:
        w.seq.length += len(w.op.tokens)
    bases = [w.seq.length for w in work]  # committed entries after the extend: where the drafts go
    trees = [tuple(parents_of(w.op)) for w in work]
    # an entry without room for its drafts and a guess past the committed entries (the context's end) gets none
    valid = [b + len(w.op.ahead) + 1 <= engine.max_context for w, b in zip(work, bases, strict=True)]
    b = r.batch_bucket(len(work))
    t = extend_bucket(max(map(len, new))) if any(new) else 0
    a = max(len(p) for p in trees)
    d = max(max(_depths(p)) for p in trees)
    topk, steps = work[0].op.topk, max(w.op.num_steps for w in work)
    tried = max(max(np.bincount(np.array(p) + 1, minlength=1)) for p in trees)  # most children of one node
    k = min(tried + GUESSES, head.cfg.draft_vocab_size)
    others = sum((len(p) + 1) * GUESSES - 1 for p, v in zip(trees, valid, strict=True) if v)
    scratch = [r.allocate() for _ in range(min(r.free_slots, others, engine.ahead_slots))]  # (--ahead-slots)
    try:
        m = r.batch_bucket(len(scratch)) if scratch else 0
        gather = t > 0 and ring is not None and all(w.rows is not None for w, n in zip(work, new, strict=True) if n)
        table = _draft_ids(engine)
        rows = []
        for w, n, start, base, tree, ok in zip(work, new, starts, bases, trees, valid, strict=True):
            ahead = w.op.ahead + [0] * (a - len(w.op.ahead))
            rows.append([w.seq.slot, max(len(n) - 1, 0), len(n), start, base, ok, w.seq.slot if ok else r.pad_slot,
                         *n, *[0] * (t - len(n)), *ahead, *[table.get(x, 0) for x in ahead],
                         *[x in table for x in ahead], *_tree(tree, a, d),
                         *((w.rows or [])[: len(n)] + [0] * (t - len(n)) if gather else [])])
        pad = [r.pad_slot, 0, 0, 0, 0, 0, r.pad_slot, *[0] * (t + 3 * a), *_tree((), a, d), *[0] * (t if gather else 0)]
        ints = np.array(rows + [pad] * (b - len(rows)), dtype=np.int64)
        inputs: dict[str, np.ndarray | torch.Tensor] = {
            "ints": ints, "scratch": np.array(scratch + [r.pad_slot] * (m - len(scratch)), dtype=np.int64)}
        if t and not gather:
            read = {j: w.read(ring) for j, (w, n) in enumerate(zip(work, new, strict=True)) if n}
            none = next(iter(read.values()))[:0]
            inputs["feats"] = padded_rows([read.get(j, none) for j in range(len(work))], b, t)
        top = max(bases)
        # (the scratch slots' copies of the sequences' entries: whole slots with the fused head, one graph for every
        # context length, else the context bucket)
        copied = r.cache.max_len if r.fused_head is not None else r.ctx_bucket(max(top, 1))
        views = (engine._views(b * max(t, 1), top + t), engine._views(b * a, top + a), copied,
                 engine._views(b + m, top + d + 1), engine._views((b + m) * topk, top + d + 1 + (steps - 1) * topk))
        source = ("ring", ring.data_ptr()) if gather and ring is not None else None

        def fn(ints: torch.Tensor, scratch: torch.Tensor, feats: torch.Tensor | None = None) -> tuple[torch.Tensor]:
            return (_ahead_fn(engine, ints, scratch, feats, ring if gather else None, t, a, d, k, topk, steps, views),)

        (packed,) = r.graphed(("ahead", b, t, a, d, k, m, topk, steps, views, source,
                               None if "feats" not in inputs else inputs["feats"].shape[-1]), fn, **inputs)
        assert packed is not None
        host = packed.tolist()
    finally:
        for slot in scratch:
            r.release(slot)
    n_tree = topk + (steps - 1) * topk * topk
    for i, row in enumerate(host[: len(work)] + host[b : b + len(scratch)]):
        entry = i if i < len(work) else row[0]
        if i < len(work) and not valid[i]:
            continue
        w = work[entry]
        ids, parents = tree_result(row[4 : 4 + n_tree], row[4 + n_tree : 4 + 2 * n_tree], row[4 + 2 * n_tree :],
                                   topk, w.op.num_steps, w.greedy_shape[2])  # type: ignore[index]
        out[entry].ahead.append(AheadOutcome(row[2], row[3], ids, parents if topk > 1 else [], row[1]))


def _ahead_fn(engine: DraftEngine, ints: torch.Tensor, scratch: torch.Tensor, feats: torch.Tensor | None,
              ring: torch.Tensor | None, t: int, a: int, d: int, k: int, topk: int, steps: int,
              views: tuple[int, int, int, int, int]) -> torch.Tensor:
    """The static part of drafting ahead for B entries (see _draft_ahead's integers): extend,
    the tree's forwards, the candidates, their slots' entries, the guesses' step and growth.
    Returns [B + M, 4 + 3N]: for each entry's own outcome, then the M others best first: its
    entry, node, accepted drafts, guess, then its grown tree (grow_trees' target ids, parents
    and order)."""
    r, head, dev = engine.runner, engine.head, ints.device
    ctx_e, ctx_t, ctx_c, ctx_g, ctx_grow = views
    b = ints.shape[0]
    slot, last, count, start, base, valid, own = ints[:, :_HEAD].unbind(1)
    at = _HEAD + t
    tokens, drafts, draft_ids = ints[:, _HEAD:at], ints[:, at : at + a], ints[:, at + a : at + 2 * a]
    in_vocab, parents = ints[:, at + 2 * a : at + 3 * a].bool(), ints[:, at + 3 * a : at + 4 * a]
    in_use, depth = ints[:, at + 4 * a : at + 5 * a].bool(), ints[:, at + 5 * a : at + 6 * a + 1]  # [B, A], [B, A+1]
    at += 6 * a + 1
    paths = ints[:, at : at + (a + 1) * d].view(b, a + 1, d)
    at += (a + 1) * d
    mask = ints[:, at : at + a * a].view(b, a, a).bool()
    best = ints[:, at + a * a]  # [B] the row of the best path's end
    lanes = torch.arange(b, device=dev)
    root = engine.last_hidden[slot]  # [B, H]
    if t:  # 1. the extend (entries without one keep their state)
        positions = start[:, None] + torch.arange(t, device=dev)
        if feats is None:
            assert ring is not None
            feats = ring[ints[:, at + a * a + 1 :]]  # [B, T, 3H]
        _, prenorm = r.padded_forward(tokens, positions, slot, positions, ctx_e, hidden=feats)
        assert prenorm is not None
        root = torch.where((count > 0)[:, None], prenorm[lanes, last], root)
        engine.last_hidden[slot] = root  # (padding entries: the padding slot's)
    # 2. the tree: a forward per level over every node, each fed its parent's state from the one before
    entries = base[:, None] + torch.arange(a, device=dev)  # [B, A]
    rel = torch.arange(ctx_t, device=dev)[None, None] - base[:, None, None]  # [B, 1, ctx]
    visible = (rel < 0) | ((rel < a) & mask.gather(2, rel.clamp(0, a - 1).expand(b, a, ctx_t)))  # [B, A, ctx]
    states = root[:, None].expand(b, a + 1, root.shape[-1]).contiguous()  # [B, A+1, H] root, then nodes
    node_logits = root.new_zeros(0)
    for _ in range(d):
        inputs = states.gather(1, (parents + 1)[..., None].expand(b, a, states.shape[-1]))
        node_logits, prenorm = r.padded_forward(drafts, base[:, None] + depth[:, 1:] - 1, slot, entries, ctx_t,
                                                visible=visible, hidden=inputs)
        states = torch.cat([root[:, None], prenorm.to(root.dtype)], dim=1)  # type: ignore[union-attr]
    # 3. candidates: each row's best tokens the verify does not try there, scored by the outcome's log-probability
    root_logits = head.lm_head(head.norm(root)).float()
    lp = torch.log_softmax(torch.cat([root_logits[:, None], node_logits.float()], dim=1), dim=-1)  # [B, A+1, Vd]
    values, ids = lp.topk(k, dim=-1)  # [B, A+1, K]
    top = head.to_target_ids(ids)
    own_lp = lp[lanes[:, None], parents + 1, draft_ids].double()  # [B, A] each draft after its parent
    own_lp = torch.where(in_vocab, own_lp, float("-inf"))
    score = torch.zeros(b, a + 1, dtype=torch.float64, device=dev)
    for _ in range(d):  # root first: after D rounds every node's path is summed
        score = torch.cat([score[:, :1], score.gather(1, parents + 1) + own_lp], dim=1)
    under = (parents + 1)[..., None].expand(b, a, k)
    hit = (top.gather(1, under) == drafts[..., None]) & in_use[..., None]  # [B, A, K] a draft offered by its parent
    tried = torch.zeros(b, a + 1, k, dtype=torch.int32, device=dev).scatter_add_(1, under, hit.int()) > 0
    rank = torch.cumsum((~tried).int(), dim=-1)
    pick = torch.stack([((~tried) & (rank == g + 1)).int().argmax(-1) for g in range(GUESSES)], dim=-1)  # [B,A+1,G]
    guess, value = top.gather(-1, pick), values.gather(-1, pick).double()
    scores = (score[..., None] + value).flatten()  # [B·(A+1)·G] in creation order
    rows_ = torch.arange(a + 1, device=dev)
    usable = valid.bool()[:, None, None] & torch.cat([in_use.new_ones(b, 1), in_use], dim=1)[..., None]
    usable = usable & ~((rows_[None, :, None] == best[:, None, None]) & (torch.arange(GUESSES, device=dev) == 0))
    order = torch.sort(scores, descending=True, stable=True).indices  # most likely first, ties in creation order
    order = order[torch.sort(usable.flatten()[order].int(), descending=True, stable=True).indices]
    chosen = order[torch.arange(scratch.shape[0], device=dev) % order.shape[0]]  # (more slots than candidates: unused)
    entry = torch.cat([lanes, chosen // ((a + 1) * GUESSES)])  # [R] the outcomes: each entry's own, then the others
    row = torch.cat([best, chosen // GUESSES % (a + 1)])
    g = torch.cat([torch.zeros_like(best), chosen % GUESSES])
    slots, src, where = torch.cat([own, scratch]), slot[entry], base[entry]
    accepted = depth[entry, row]  # [R]
    # 4. each outcome's slot: the sequence's entries, then its accepted drafts in a row (all read before any write)
    path = where[:, None] + paths[entry, row]  # [R, D] where the accepted drafts' entries are now
    cache = r.cache
    for kv in (cache.k, cache.v):  # [layers, slots, entries, kv_heads, head_dim]
        moved = kv[:, src[:, None], path]  # [layers, R, D, ...]
        kv[:, scratch, :ctx_c] = kv[:, src[b:], :ctx_c]
        kv[:, slots[:, None], where[:, None] + torch.arange(d, device=dev)] = moved  # (past the path: overwritten)
    # 5. each outcome's guess, then its chain or tree
    guessed, hidden = guess[entry, row, g], states[entry, row]  # [R], [R, H]
    positions = (where + accepted)[:, None]
    logits, prenorm = r.padded_forward(guessed[:, None], positions, slots, positions, ctx_g, hidden=hidden[:, None])
    assert prenorm is not None
    (grown,) = engine._grow_fn(logits[:, 0], prenorm[:, 0], where + accepted + 1, slots, topk, steps, ctx_grow)
    return torch.cat([torch.stack([entry, row - 1, accepted, guessed], dim=1), grown], dim=1)


def _draft_ids(engine: DraftEngine) -> dict[int, int]:
    """Target id -> draft-vocabulary id, for the tokens the head can propose (made once)."""
    table: dict[int, int] | None = getattr(engine, "_ahead_draft_ids", None)
    if table is None:
        ids = engine.head.to_target_ids(torch.arange(engine.head.cfg.draft_vocab_size, device=engine.device))
        table = {t: i for i, t in enumerate(ids.tolist())}
        engine._ahead_draft_ids = table  # type: ignore[attr-defined]
    return table
