"""Per-step TTT objective: soft cross-entropy (forward KL up to a constant) from the target's
distribution restricted to the draft vocabulary, and argmax acceptance per position.

A batch holds right-padded sequences x [B, T] with lengths L and prompt lengths P. The
target's logits at position q predict x[q+1]; step k at training position i is scored
against q = i + 1 + k. Positions count where the target predicts a response token and
the next token is in the data: P - 1 <= q <= L - 2. As in SpecForge, a position whose
target argmax is outside the draft vocabulary adds no loss and counts as a miss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] right-padded with 0
    lengths: torch.Tensor  # [B]
    prompt_lens: torch.Tensor  # [B]


@dataclass
class Targets:
    probs: torch.Tensor  # [B, T, Vd] fp32: target distribution restricted to the draft vocabulary
    top: torch.Tensor  # [B, T] draft id of the target's argmax (valid where in_vocab)
    in_vocab: torch.Tensor  # [B, T] bool: the target's argmax over the full vocabulary is a draft token


def make_targets(logits: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor) -> Targets:
    """logits [B, T, V] (target, any float dtype) -> Targets."""
    restricted = logits[..., draft_ids].float()  # [B, T, Vd]
    return Targets(torch.softmax(restricted, dim=-1), restricted.argmax(-1), t2d[logits.argmax(-1)])


def loss_mask(batch: Batch, step: int, n: int) -> torch.Tensor:
    """[B, n] bool: training positions i whose step-`step` target q = i + 1 + step counts."""
    q = torch.arange(n, device=batch.tokens.device)[None, :] + 1 + step
    return (q >= batch.prompt_lens[:, None] - 1) & (q <= batch.lengths[:, None] - 2)


@dataclass
class StepResult:
    loss: torch.Tensor  # scalar, differentiable
    correct: torch.Tensor  # [B, n] bool: draft argmax == target argmax and the position counts
    counted: torch.Tensor  # [B, n] bool: the loss mask


def step_loss(logits: torch.Tensor, targets: Targets, batch: Batch, step: int) -> StepResult:
    """logits [B, n, Vd] of step `step` (n = T - 1 training positions)."""
    n = logits.shape[1]
    span = slice(1 + step, 1 + step + n)  # q for i = 0..n-1; shorter near the end
    probs, top, inv = targets.probs[:, span], targets.top[:, span], targets.in_vocab[:, span]
    m = n - step  # positions whose q falls inside the batch
    counted = loss_mask(batch, step, n)[:, :m]
    use = counted & inv
    logp = F.log_softmax(logits[:, :m].float(), dim=-1)
    ce = -(probs * logp).sum(-1)  # [B, m]
    loss = (ce * use).sum() / counted.sum().clamp(min=1)
    correct = (logits[:, :m].argmax(-1) == top) & use
    pad = torch.zeros(logits.shape[0], step, dtype=torch.bool, device=logits.device)
    return StepResult(loss, torch.cat([correct, pad], 1), torch.cat([counted, pad], 1))
