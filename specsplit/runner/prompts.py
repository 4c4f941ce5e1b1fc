"""Rows from entry 0 (prompts, recomputed sequences): a few forwards for any number of them.

Each row is padded to its own length's bucket, so its shape, and with it the bits it computes,
do not depend on the other rows of its step; rows of one bucket run as one forward of the
prompts layout (specsplit.models.batch), up to PROMPT_TOKENS padded tokens a forward. Attention
then takes no mask and reads no cache, and the model computes logits for each row's last token
only: a prefill needs no others, and they would be the largest tensor of the step.
"""

from __future__ import annotations

import torch

from specsplit.models.batch import Batch
from specsplit.models.eagle3 import Eagle3Head
from specsplit.models.layers import KVCache
from specsplit.models.llama import LlamaModel
from specsplit.runner.outputs import RowOutputs, Verified
from specsplit.runner.packing import Row

PROMPT_TOKENS = 8192  # padded tokens of one forward (a longer row runs alone)


def prompt_bucket(n: int, most: int) -> int:
    """The padded length of a row of n tokens: a multiple of 16 up to 256, of 64 above; at most `most`."""
    step = 16 if n <= 256 else 64
    return min(-(-n // step) * step, most)


def prompt_groups(lengths: list[int], most: int) -> list[list[int]]:
    """Indices of rows that run as one forward: those of one bucket, longest bucket first, in
    their order, at most PROMPT_TOKENS padded tokens a group (at least one row)."""
    by_bucket: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_bucket.setdefault(prompt_bucket(n, most), []).append(i)
    groups = []
    for t in sorted(by_bucket, reverse=True):
        rows = by_bucket[t]
        size = max(1, PROMPT_TOKENS // t)
        groups += [rows[j : j + size] for j in range(0, len(rows), size)]
    return groups


def run_prompts(model: LlamaModel | Eagle3Head, cache: KVCache, rows: list[Row], hidden: list[torch.Tensor] | None,
                capture: bool, verify: bool) -> list[Verified]:
    """Each row's outputs (logits [1, V] of its last token, features [T, X]) and, with `verify`,
    the argmax after its last token (`best`; one readback per forward)."""
    dev = cache.k.device
    out: list[Verified | None] = [None] * len(rows)
    for group in prompt_groups([len(r.tokens) for r in rows], cache.max_len):
        lengths = [len(rows[i].tokens) for i in group]
        t = prompt_bucket(max(lengths), cache.max_len)
        tokens = torch.zeros(len(group), t, dtype=torch.long)  # [B, T]
        for j, i in enumerate(group):
            tokens[j, : lengths[j]] = torch.tensor(rows[i].tokens)
        slots = torch.tensor([rows[i].slot for i in group], device=dev)  # [B]
        h = None
        if hidden is not None:  # [B*T, W]
            h = hidden[group[0]].new_zeros(len(group), t, hidden[group[0]].shape[-1])
            for j, i in enumerate(group):
                h[j, : lengths[j]] = hidden[i]
            h = h.view(len(group) * t, -1).to(dev)
        batch = Batch.prompt_rows(lengths, slots, t, capture, h)
        logits, extra = model.forward(tokens.view(-1).to(dev), batch, cache)  # [B, V], [B*T, X]
        outputs = RowOutputs(logits, extra, [(j * t, j * t + n) for j, n in enumerate(lengths)],
                             [(j, j + 1) for j in range(len(group))])
        best = logits.argmax(-1).tolist() if verify else [-1] * len(group)
        for j, i in enumerate(group):
            out[i] = Verified(outputs, j, [0], [best[j]])
    return out  # type: ignore[return-value]
