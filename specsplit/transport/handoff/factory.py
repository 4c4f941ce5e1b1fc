"""Pick a handoff backend by name."""

from __future__ import annotations

import torch

from specsplit.transport.handoff.base import Descriptor, HiddenReader, HiddenWriter

BACKENDS = ("shm", "inline", "cuda_ipc")

Device = str | int | torch.device | None


def open_writer(backend: str, capacity_rows: int, width: int, dtype: torch.dtype,
                device: Device = None) -> HiddenWriter:
    """`device` places the ring: used by "cuda_ipc" (default: the current CUDA device);
    "shm" and "inline" keep their rows on the CPU whatever it says."""
    if backend == "shm":
        from specsplit.transport.handoff.shm import ShmWriter

        return ShmWriter(capacity_rows, width, dtype)
    if backend == "inline":
        from specsplit.transport.handoff.inline import InlineWriter

        return InlineWriter(capacity_rows, width, dtype)
    if backend == "cuda_ipc":
        from specsplit.transport.handoff.cuda_ipc import CudaIpcWriter

        return CudaIpcWriter(capacity_rows, width, dtype, device)
    raise ValueError(f"unknown hidden-state backend {backend!r}; choose from {BACKENDS}")


def open_reader(desc: Descriptor, device: Device = None) -> HiddenReader:
    """`device` is where "cuda_ipc" reads land (default: the writer's device index);
    "shm" and "inline" read onto the CPU whatever it says."""
    if desc.backend == "shm":
        from specsplit.transport.handoff.shm import ShmReader

        return ShmReader(desc)
    if desc.backend == "inline":
        from specsplit.transport.handoff.inline import InlineReader

        return InlineReader(desc)
    if desc.backend == "cuda_ipc":
        from specsplit.transport.handoff.cuda_ipc import CudaIpcReader

        return CudaIpcReader(desc, device)
    raise ValueError(f"unknown hidden-state backend {desc.backend!r}")
