"""Triton kernel of the draft's proposal: the k most likely tokens of each row of logits, with
their log-probabilities, in one kernel (draft_service.tree.top_log_probs). Unfused it is a
log-softmax over the row and a top-k: at a few rows of a whole draft vocabulary the top-k runs one
block per row over every entry (~10-30 µs on the H200). Here one program holds its row in
registers: the max and the sum of exponentials (log-softmax's), then k rounds of max and
lowest index among equal values, each round masking its pick.

Registered as the custom op `specsplit::top_log_probs`, so that torch.compile keeps it whole
inside a compiled cycle (this module keeps its annotations evaluated: the op's schema is read
from them).
"""

import torch
import triton
import triton.language as tl

MAX_VOCAB = 16384  # one program holds its row: larger vocabularies keep the unfused path


@triton.jit
def _top_log_probs(x_ptr, val_ptr, idx_ptr, V, stride, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    log_sum = tl.log(tl.sum(tl.exp(x - top), axis=0))
    for j in tl.static_range(K):
        best = tl.max(x, axis=0)
        at = tl.min(tl.where(x == best, offs, BLOCK), axis=0)  # the lowest index of the largest
        at = tl.minimum(at, V - 1)  # (a row of NaNs matches nothing: still an index in the vocabulary)
        tl.store(val_ptr + row * K + j, (best - top) - log_sum)  # as log_softmax rounds it: (x - max) - log Σ
        tl.store(idx_ptr + row * K + j, at.to(tl.int64))
        x = tl.where(offs == at, float("-inf"), x)


@torch.library.custom_op("specsplit::top_log_probs", mutates_args=())
def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] (V ≤ MAX_VOCAB, k ≤ V) -> the k largest log-probabilities [..., k] float32,
    largest first, and their indices [..., k] int64 (ties: the lowest index first)."""
    v = logits.shape[-1]
    if not 1 <= k <= v or v > MAX_VOCAB:
        raise ValueError(f"top_log_probs: k {k} of a vocabulary of {v} (at most {MAX_VOCAB})")
    rows = logits.reshape(-1, v).contiguous()  # [R, V]
    shape = (*logits.shape[:-1], k)
    values = torch.empty(shape, dtype=torch.float32, device=logits.device)  # [..., K], laid out as [R, K]
    ids = torch.empty(shape, dtype=torch.int64, device=logits.device)
    block = triton.next_power_of_2(v)
    if rows.shape[0]:
        _top_log_probs[(rows.shape[0],)](rows, values, ids, v, rows.stride(0), K=k, BLOCK=block,
                                         num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4)
    return values, ids


@top_log_probs.register_fake
def _(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*logits.shape[:-1], k)
    return (logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64))
