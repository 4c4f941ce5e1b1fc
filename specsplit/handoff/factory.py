"""Pick a handoff backend by name."""

from __future__ import annotations

import torch

from specsplit.handoff.base import Descriptor, HiddenReader, HiddenWriter

BACKENDS = ("shm", "inline")


def open_writer(backend: str, capacity_rows: int, width: int, dtype: torch.dtype) -> HiddenWriter:
    if backend == "shm":
        from specsplit.handoff.shm import ShmWriter

        return ShmWriter(capacity_rows, width, dtype)
    if backend == "inline":
        from specsplit.handoff.inline import InlineWriter

        return InlineWriter(capacity_rows, width, dtype)
    raise ValueError(f"unknown hidden-state backend {backend!r}; choose from {BACKENDS}")


def open_reader(desc: Descriptor) -> HiddenReader:
    if desc.backend == "shm":
        from specsplit.handoff.shm import ShmReader

        return ShmReader(desc)
    if desc.backend == "inline":
        from specsplit.handoff.inline import InlineReader

        return InlineReader(desc)
    raise ValueError(f"unknown hidden-state backend {desc.backend!r}")
