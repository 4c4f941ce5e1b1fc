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


# Counter-based draws (the target's): a position's draws are a hash of (seed, position, stream),
# so a sampled token depends on its request's seed, its position and the logits only: the same
# in any process, on every tensor-parallel rank, however the steps were batched.
ACCEPT, PICK = 1, 2  # streams: a draft token's acceptance; the token chosen after a position
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An avalanching 32-bit integer hash of x in [0, 2^32) (int64; products stay below 2^63)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def uniforms(seed: int, positions: torch.Tensor, stream: int, width: int) -> torch.Tensor:
    """positions [N] -> uniforms in (0, 1) [N, width] float64, one row per position of `stream`."""
    key = _mix32((positions.long() * 4 + stream) & _M32) ^ (seed & _M32)
    key = _mix32(_mix32(key) ^ ((seed >> 32) & _M32))  # [N]
    cols = _mix32(torch.arange(width, device=positions.device) ^ 0x5BD1E995)  # [W]
    return (_mix32(key[:, None] ^ cols[None]).double() + 0.5) / 2.0**32


def pick(probs: torch.Tensor, seed: int, positions: torch.Tensor) -> torch.Tensor:
    """One token from each row of probs [N, V], the token after each of `positions` [N] (Gumbel-max
    on the PICK stream) -> [N] long."""
    gumbel = -torch.log(-torch.log(uniforms(seed, positions, PICK, probs.shape[-1])))
    return torch.argmax(torch.log(probs.double()) + gumbel, dim=-1)


def select_token(logits: torch.Tensor, s: Sampling, position: int) -> int:
    """The token at `position` from the logits [V] after the one before it."""
    if s.greedy:
        return int(torch.argmax(logits))
    at = torch.tensor([position], device=logits.device)
    return int(pick(probs_from_logits(logits[None], s), s.seed, at)[0])


def dense(dist: SparseDist, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    q = torch.zeros(vocab, device=device)
    q[torch.tensor(dist[0], dtype=torch.long, device=device)] = torch.tensor(dist[1], dtype=torch.float32,
                                                                             device=device)
    return q


def verify_chain(logits: torch.Tensor, draft_ids: list[int], draft_dists: list[SparseDist], s: Sampling,
                 position: int) -> tuple[int, list[int]]:
    """Target logits [k+1, V] for [last, d1..dk], the first draft token at `position` ->
    (accepted count a, tokens d1..da + one more), for a sampled sequence (greedy ones accept in
    the verify step: specsplit.runner.acceptance). Standard speculative sampling with the draft's
    probabilities q (accept d_i with min(1, p/q), on rejection sample from norm(max(0, p - q))),
    which preserves the target's distribution exactly; every row's draws at once, one readback."""
    k = len(draft_ids)
    p = probs_from_logits(logits, s)  # [k+1, V]
    dev = p.device
    at = torch.arange(position, position + k + 1, device=dev)  # each row's next token's position
    if not k:
        return 0, [int(pick(p, s.seed, at)[0])]
    q = torch.stack([dense(d, p.shape[-1], dev) for d in draft_dists])  # [k, V]
    x = torch.tensor(draft_ids, device=dev)[:, None]
    px, qx = p[:k].gather(1, x)[:, 0], q.gather(1, x)[:, 0]
    ok = (qx > 0) & (uniforms(s.seed, at[:k], ACCEPT, 1)[:, 0] * qx < px)  # [k]
    residual = torch.clamp(p[:k] - q, min=0.0)
    total = residual.sum(-1, keepdim=True)
    rows = torch.cat([torch.where(total > 0, residual / total.clamp(min=1e-30), p[:k]), p[k:]])  # [k+1, V]
    accepted = ok.long().cumprod(0).sum()  # drafts accepted before the first rejection
    a, *tokens = torch.cat([accepted[None], pick(rows, s.seed, at)]).tolist()
    return a, [*draft_ids[:a], tokens[a]]
