"""Token selection: greedy, filtered sampling, sampled chain verification (lossless)."""

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


def verify_chain(logits: torch.Tensor, draft_ids: list[int], draft_dists: list[SparseDist], s: Sampling,
                 gen: torch.Generator) -> tuple[int, list[int]]:
    """Target logits [k+1, V] for [last, d1..dk] -> (accepted count a, tokens d1..da + one more),
    for a sampled sequence (greedy ones accept in the verify step: specsplit.runner.acceptance).
    Standard speculative sampling with the draft's probabilities q (accept with min(1, p/q), on
    rejection sample from norm(max(0, p - q))), which preserves the target's distribution exactly.
    """
    k = len(draft_ids)
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
