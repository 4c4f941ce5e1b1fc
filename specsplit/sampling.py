"""Token selection: greedy, filtered sampling, sampled chain verification (lossless).

The target's draws are counter-based: a position's uniforms are a hash of (the request's seed,
the position, a stream: what they decide), so a sampled token depends on its request's seed,
its position and the logits only: the same in any process, on every tensor-parallel rank, and
whether its step decoded one token or several (each chosen on the device by `choose`).
"""

from __future__ import annotations

import numpy as np
import torch

from specsplit.ops import Sampling, SparseDist

ACCEPT, PICK = 1, 2  # streams: a draft token's acceptance; the token chosen after a position
_M32 = 0xFFFFFFFF


def sampling_rows(samplings: list[Sampling]) -> np.ndarray:
    """Each row's sampling as numbers [B, 5] float64: temperature (0: greedy), top_p, top_k and
    the seed's low and high 32 bits (exact in float64), for steps that choose on the device."""
    return np.array([(0.0 if s.greedy else s.temperature, s.top_p, s.top_k, s.seed & _M32, (s.seed >> 32) & _M32)
                     for s in samplings], dtype=np.float64).reshape(-1, 5)


def _rows(s: Sampling, n: int, device: torch.device | str) -> torch.Tensor:
    return torch.from_numpy(sampling_rows([s])).to(device).expand(n, 5)


def _filtered(s: Sampling) -> bool:
    return s.top_k > 0 or s.top_p < 1.0


def probs_rows(logits: torch.Tensor, rows: torch.Tensor, filtered: bool = True) -> torch.Tensor:
    """logits [B, V] -> probabilities [B, V] after each row's temperature, top-k and top-p (rows
    [B, 5], see sampling_rows). No host synchronisation: capturable. `filtered` False: no row has
    top-k or top-p (the same numbers, without the sorts)."""
    v = logits.shape[-1]
    x = logits.float() / rows[:, 0:1].float().clamp(min=1e-6)
    if not filtered:
        return torch.softmax(x, dim=-1)
    top_k = rows[:, 2:3].long()
    kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (top_k - 1).clamp(0, v - 1))  # [B, 1]
    x = torch.where((top_k > 0) & (top_k < v) & (x < kth), float("-inf"), x)
    probs = torch.softmax(x, dim=-1)
    top_p = rows[:, 1:2].float()
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(before >= top_p, 0.0))
    return torch.where(top_p < 1.0, kept / kept.sum(-1, keepdim=True), probs)


def probs_from_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] after temperature, top-k and top-p."""
    return probs_rows(logits, _rows(s, logits.shape[0], logits.device), _filtered(s))


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from probs [V] with a generator (the draft's proposals)."""
    return int(torch.multinomial(probs, 1, generator=gen))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An avalanching 32-bit integer hash of x in [0, 2^32) (int64; products stay below 2^63)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int, width: int) -> torch.Tensor:
    """seeds [N, 2] (each row's seed's low and high 32 bits, as sampling_rows holds them) and
    positions [N] -> uniforms in (0, 1) [N, width] float64 of `stream`. Capturable."""
    lo, hi = seeds[:, 0].long(), seeds[:, 1].long()
    key = _mix32(_mix32(_mix32((positions.long() * 4 + stream) & _M32) ^ lo) ^ hi)  # [N]
    cols = _mix32(torch.arange(width, device=positions.device) ^ 0x5BD1E995)  # [W]
    return (_mix32(key[:, None] ^ cols[None]).double() + 0.5) / 2.0**32


def pick(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token from each row of probs [N, V], the token at each of `positions` [N] (Gumbel-max
    on the PICK stream; seeds [N, 2] as uniforms takes them) -> [N] long."""
    gumbel = -torch.log(-torch.log(uniforms(seeds, positions, PICK, probs.shape[-1])))
    return torch.argmax(torch.log(probs.double()) + gumbel, dim=-1)


def choose(logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, filtered: bool = True) -> torch.Tensor:
    """Each row's token at its position [B] from the logits [B, V] after the token before it:
    greedy rows' argmax, the others' draw from their filtered distribution (rows [B, 5], see
    sampling_rows; `filtered` as probs_rows takes it) -> [B] long. Capturable."""
    sampled = pick(probs_rows(logits, rows, filtered), rows[:, 3:5], positions)
    return torch.where(rows[:, 0] > 0, sampled, torch.argmax(logits, dim=-1))


def select_token(logits: torch.Tensor, s: Sampling, position: int) -> int:
    """The token at `position` from the logits [V] after the one before it."""
    if s.greedy:
        return int(torch.argmax(logits))
    at = torch.tensor([position], device=logits.device)
    return int(choose(logits[None], _rows(s, 1, logits.device), at, _filtered(s))[0])


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
    which preserves the target's distribution exactly; every row's draws at once, one readback.
    Without drafts, the token select_token chooses (as a step decoding ahead chooses it)."""
    k = len(draft_ids)
    if not k:
        return 0, [select_token(logits[0], s, position)]
    dev = logits.device
    rows = _rows(s, k + 1, dev)
    p = probs_rows(logits, rows, _filtered(s))  # [k+1, V]
    at = torch.arange(position, position + k + 1, device=dev)  # each row's next token's position
    q = torch.stack([dense(d, p.shape[-1], dev) for d in draft_dists])  # [k, V]
    x = torch.tensor(draft_ids, device=dev)[:, None]
    px, qx = p[:k].gather(1, x)[:, 0], q.gather(1, x)[:, 0]
    ok = (qx > 0) & (uniforms(rows[:k, 3:5], at[:k], ACCEPT, 1)[:, 0] * qx < px)  # [k]
    residual = torch.clamp(p[:k] - q, min=0.0)
    total = residual.sum(-1, keepdim=True)
    candidates = torch.cat([torch.where(total > 0, residual / total.clamp(min=1e-30), p[:k]), p[k:]])  # [k+1, V]
    accepted = ok.long().cumprod(0).sum()  # drafts accepted before the first rejection
    a, *tokens = torch.cat([accepted[None], pick(candidates, rows[:, 3:5], at)]).tolist()
    return a, [*draft_ids[:a], tokens[a]]
