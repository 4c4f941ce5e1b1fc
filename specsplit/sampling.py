"""Token selection: greedy, filtered sampling, and chain verification (lossless)."""

from __future__ import annotations

import torch

from specsplit.ops import Sampling, SparseDist


def probs_from_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] after temperature, top-k and top-p."""
    logits = logits.float() / max(s.temperature, 1e-6)
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= s.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=gen))


def select_token(logits: torch.Tensor, s: Sampling, gen: torch.Generator) -> int:
    """One token from logits [V]."""
    if s.greedy:
        return int(torch.argmax(logits))
    return sample(probs_from_logits(logits[None], s)[0], gen)


def dense(dist: SparseDist, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    q = torch.zeros(vocab, device=device)
    q[torch.tensor(dist[0], dtype=torch.long, device=device)] = torch.tensor(dist[1], dtype=torch.float32,
                                                                             device=device)
    return q


def greedy_chain(best: list[int], draft_ids: list[int]) -> tuple[int, list[int]]:
    """Greedy verification of a chain: best[i] is the target's argmax after [last, d1..di] ->
    (accepted count a: drafts equal to the argmax before them, tokens d1..da + best[a])."""
    a = 0
    while a < len(draft_ids) and draft_ids[a] == best[a]:
        a += 1
    return a, [*draft_ids[:a], best[a]]


def verify_chain(logits: torch.Tensor, draft_ids: list[int], draft_dists: list[SparseDist], s: Sampling,
                 gen: torch.Generator) -> tuple[int, list[int]]:
    """Target logits [k+1, V] for [last, d1..dk] -> (accepted count a, tokens d1..da + one more).

    Greedy: accept while the draft equals the target's argmax (greedy_chain). Sampling: standard
    speculative sampling with the draft's probabilities q (accept with min(1, p/q),
    on rejection sample from norm(max(0, p - q))), which preserves the target's
    distribution exactly.
    """
    k = len(draft_ids)
    if s.greedy:
        return greedy_chain(torch.argmax(logits, dim=-1).tolist(), draft_ids)
    p = probs_from_logits(logits, s)  # [k+1, V]
    vocab = p.shape[-1]
    for i, x in enumerate(draft_ids):
        q = dense(draft_dists[i], vocab, p.device)
        u = float(torch.rand(1, generator=gen, device=gen.device))
        if q[x] > 0 and u * float(q[x]) < float(p[i, x]):
            continue
        residual = torch.clamp(p[i] - q, min=0.0)
        total = float(residual.sum())
        return i, [*draft_ids[:i], sample(residual / total if total > 0 else p[i], gen)]
    return k, [*draft_ids, sample(p[k], gen)]


def verify_tree(best: list[int], draft_ids: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """Greedy verification of a tree. best[i] is the target's argmax after verified token i of
    [last, d1..dn]; parents[i] is the index (into draft_ids) of d(i+1)'s parent, -1 for a child of
    `last`. Walks down from `last` while one of the children is the target's argmax -> (path:
    indices into the n+1 verified tokens, 0 = last, one per accepted draft after it; emitted
    tokens: the accepted drafts + the target's own next token)."""
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node; node 0 is `last`
    for i, (token, parent) in enumerate(zip(draft_ids, parents, strict=True)):
        children.setdefault((parent + 1, token), i + 1)
    path, node = [0], 0
    while (child := children.get((node, best[node]))) is not None:
        path.append(child)
        node = child
    return path, [draft_ids[i - 1] for i in path[1:]] + [best[node]]


def forced_chain(best: list[int], draft_ids: list[int], forced: int) -> tuple[int, list[int]]:
    """Benchmark only: `forced` drafts accepted (at most all), then the target's argmax after
    them. best as for greedy_chain."""
    a = min(forced, len(draft_ids))
    return a, [*draft_ids[:a], best[a]]


def forced_tree(best: list[int], draft_ids: list[int], parents: list[int], forced: int
                ) -> tuple[list[int], list[int]]:
    """Benchmark only: the path down each node's first child, `forced` deep (or to a leaf),
    then the target's argmax after it; best and the return as verify_tree."""
    path, node = [0], 0
    while len(path) <= forced:
        child = next((i + 1 for i, p in enumerate(parents) if p + 1 == node), None)
        if child is None:
            break
        path.append(child)
        node = child
    return path, [draft_ids[i - 1] for i in path[1:]] + [best[node]]
