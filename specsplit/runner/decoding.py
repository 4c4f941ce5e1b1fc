"""Decoding ahead: k one-token steps of continuing rows in one call, each step's tokens chosen on
the device (greedy rows' argmax, sampled rows' counter-based draw: specsplit.sampling.choose)
and fed to the next, with one readback (ModelRunner.decode)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specsplit.models.batch import Batch
from specsplit.runner.graphs import HostInput, Outputs
from specsplit.runner.packing import Row, pack_rows
from specsplit.sampling import choose

if TYPE_CHECKING:
    from specsplit.runner.runner import ModelRunner, Step


def decode(r: ModelRunner, step: Step, k: int, sampling: np.ndarray | None = None) -> list[list[int]]:
    """k tokens for each row (continuing rows of one token, nothing captured): each the one
    chosen after the one before, fed back on the device; `sampling` [B, 5] (see
    specsplit.sampling.sampling_rows), None for greedy rows only. On the fused and padded paths
    the k steps run from one graph and come back in one copy; they are the kernels of k
    one-token verifies and choose as those steps' callers do, so they give the same tokens."""
    from specsplit.runner.runner import Step

    rows = step.rows
    assert not step.capture and all(len(row.tokens) == 1 and row.start > 0 for row in rows)
    b = r.batch_bucket(len(rows))
    with r.mode():
        if r.fused is not None and r.fused.takes(b, 1):
            return _graphed(r, rows, b, k, None, sampling)[: len(rows)]
        if r.padded and r.padded_tokens >= 1:
            last = max(row.start for row in rows)
            head = r.fused_head is not None and r.fused_head.takes(b, 1)  # as _run_padded
            ctxs = tuple(r.cache.max_len if head else r.ctx_bucket(last + j + 1) for j in range(k))
            return _graphed(r, rows, b, k, ctxs, sampling)[: len(rows)]
    out: list[list[int]] = [[] for _ in rows]
    for j in range(k):  # eagerly (the CPU): k one-token steps
        ones = [Row(row.slot, row.start + j, [o[-1] if o else row.tokens[0]], accept=True)
                for row, o in zip(rows, out, strict=True)]
        if sampling is None:
            got = [v.best[0] for v in r.verify(Step(ones))]
        else:
            logits = torch.cat([lg[-1:] for lg, _ in r.run(Step(ones))])  # [B, V]
            at = torch.tensor([row.start + 1 for row in ones], device=logits.device)
            filtered = bool((sampling[:, 2] > 0).any() or (sampling[:, 1] < 1).any())  # any top-k or top-p
            got = choose(logits, torch.from_numpy(sampling).to(logits.device), at, filtered).tolist()
        for o, t in zip(out, got, strict=True):
            o.append(t)
    return out


def _graphed(r: ModelRunner, rows: list[Row], b: int, k: int, ctxs: tuple[int, ...] | None,
             sampling: np.ndarray | None) -> list[list[int]]:
    """decode's k steps in one graph: fused (ctxs None) or padded (step j in context bucket ctxs[j])."""
    fused = r.fused
    packed, layout = pack_rows(rows + [Row(r.pad_slot, 0, [])] * (b - len(rows)), b, 1, ctxs is None, False)
    inputs: dict[str, HostInput] = {"packed": packed}
    if sampling is not None:  # padding rows greedy
        inputs["sampling"] = np.concatenate([sampling, np.zeros((b - len(rows), 5))])

    def fn(packed: torch.Tensor, sampling: torch.Tensor | None = None) -> Outputs:
        f = layout.unpack(packed)
        tokens, out = f["tokens"], []  # [B, 1]
        for j in range(k):
            positions, entries = f["positions"] + j, f["entries"] + j
            if ctxs is None:
                assert fused is not None
                batch = Batch.padded(positions, f["slots"], entries, 0, f["mask"])
                logits = fused.forward(tokens.reshape(-1), batch, r.cache)[0]  # [B, V]
            else:
                logits = r.padded_forward(tokens, positions, f["slots"], entries, ctxs[j])[0][:, 0]
            if sampling is None:
                tokens = logits.argmax(-1)[:, None]
            else:  # the token after entry e sits at position e + 1
                tokens = choose(logits, sampling, entries[:, 0] + 1)[:, None]
            out.append(tokens)
        return (torch.cat(out, 1),)  # [B, k]

    got = r.graphs.run(("decode", b, k, ctxs, sampling is not None), fn, **inputs)[0]
    assert got is not None
    return got.tolist()
