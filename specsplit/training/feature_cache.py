"""The frozen target's inputs to training, computed once: every training sequence's EAGLE-3
features [L, 3H] and final normed state [L, H], in two flat tensors (on the target's GPU
when they fit, else in pinned host memory). Epochs then skip the target's forward, which
otherwise runs again for every batch of every epoch. Padding rows read a zero row; the
objective never scores padded positions, and the head's attention is causal, so valid
positions never see them."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specsplit.training.distill import Sample
from specsplit.training.target import BatchedTarget

MODES = ("auto", "gpu", "cpu", "off")


def host_free_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not POSIX: do not count on host memory
        return 0


def choose_store(mode: str, target: BatchedTarget, nbytes: int) -> torch.device | None:
    """Where the cache lives: the target's GPU, the host, or None (no cache). `auto` takes at
    most half of what is free, GPU first."""
    if mode not in MODES:
        raise ValueError(f"feature_cache {mode!r} not in {MODES}")
    dev = target.device
    if mode == "off":
        return None
    if mode == "gpu":
        if dev.type != "cuda":
            raise ValueError("feature_cache gpu needs a CUDA target")
        return dev
    if mode == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda" and nbytes <= 0.5 * torch.cuda.mem_get_info(dev)[0]:
        return dev
    return torch.device("cpu") if nbytes <= 0.5 * host_free_bytes() else None


@dataclass
class FeatureCache:
    aux: torch.Tensor  # [rows + 1, 3H]: every sequence's features back to back, then one zero row
    normed: torch.Tensor  # [rows + 1, H]
    offsets: list[int]  # first row of each sequence
    lengths: list[int]

    @staticmethod
    def nbytes(samples: list[Sample], target: BatchedTarget) -> int:
        rows = sum(len(s.ids) for s in samples) + 1
        return rows * 4 * target.cfg.hidden_size * torch.empty((), dtype=target.dtype).element_size()

    @classmethod
    def build(cls, target: BatchedTarget, samples: list[Sample], store: torch.device, batches: list[list[int]],
              collate: Callable, deadline: float | None = None,
              on_batch: Callable[[int, int], None] | None = None) -> FeatureCache | None:
        """Run the target once over every sequence (in `batches` of indices); None when
        `deadline` (time.monotonic()) comes first."""
        lengths = [len(s.ids) for s in samples]
        offsets = list(itertools.accumulate(lengths, initial=0))[:-1]
        rows, h = sum(lengths) + 1, target.cfg.hidden_size
        pin = store.type == "cpu" and target.device.type == "cuda"
        aux = torch.zeros(rows, 3 * h, dtype=target.dtype, device=store, pin_memory=pin)
        normed = torch.zeros(rows, h, dtype=target.dtype, device=store, pin_memory=pin)
        done = 0
        for idx in batches:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            a, n = target.features(collate([samples[i] for i in idx], target.device).tokens)  # [B, T, 3H], [B, T, H]
            for j, i in enumerate(idx):
                o, length = offsets[i], lengths[i]
                aux[o:o + length].copy_(a[j, :length], non_blocking=pin)
                normed[o:o + length].copy_(n[j, :length], non_blocking=pin)
            done += len(idx)
            if on_batch is not None:
                on_batch(done, len(samples))
        if target.device.type == "cuda":
            torch.cuda.synchronize(target.device)
        return cls(aux, normed, offsets, lengths)

    def gather(self, idx: list[int], t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """aux [B, T, 3H], normed [B, T, H] of these sequences, right-padded to T with zero rows."""
        pad = self.aux.shape[0] - 1
        rows = torch.full((len(idx), t), pad, dtype=torch.long)
        for j, i in enumerate(idx):
            o, length = self.offsets[i], self.lengths[i]
            rows[j, :length] = torch.arange(o, o + length)
        rows = rows.to(self.aux.device)
        return self.aux[rows].to(device, non_blocking=True), self.normed[rows].to(device, non_blocking=True)
