"""POSIX shared-memory ring: the CPU backend (same host, no copy through gRPC)."""

from __future__ import annotations

import secrets
from multiprocessing import resource_tracker, shared_memory

import torch

from specsplit.transport.handoff.base import DTYPES, Allocation, Descriptor, RingAllocator, dtype_name

_OWNED: set[str] = set()  # segments this process created


def _ring_view(shm: shared_memory.SharedMemory, capacity: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(shm.buf, dtype=dtype, count=capacity * width).view(capacity, width)


class ShmWriter:
    def __init__(self, capacity_rows: int, width: int, dtype: torch.dtype) -> None:
        itemsize = torch.tensor([], dtype=dtype).element_size()
        name = f"specsplit-{secrets.token_hex(6)}"
        self.shm = shared_memory.SharedMemory(name=name, create=True, size=capacity_rows * width * itemsize)
        _OWNED.add(name)
        self.ring = _ring_view(self.shm, capacity_rows, width, dtype)  # [capacity, 3H]
        self.descriptor = Descriptor("shm", name, capacity_rows, width, dtype_name(dtype))
        self.allocator = RingAllocator(capacity_rows)

    def allocate(self, rows: int) -> Allocation | None:
        return self.allocator.allocate(rows)

    def write(self, alloc: Allocation, rows: torch.Tensor) -> None:
        # rows [n <= alloc.rows, width]; visible to the reader once this returns
        self.ring[alloc.offset : alloc.offset + rows.shape[0]].copy_(rows)

    def write_all(self, items: list[tuple[Allocation, torch.Tensor]]) -> None:
        for alloc, rows in items:
            self.write(alloc, rows)

    def ring_on(self, device: torch.device) -> torch.Tensor | None:
        return self.ring if device.type == "cpu" else None

    def release(self, generation: int) -> None:
        self.allocator.release(generation)

    def close(self) -> None:
        del self.ring
        self.shm.close()
        self.shm.unlink()


class ShmReader:
    def __init__(self, desc: Descriptor) -> None:
        self.shm = shared_memory.SharedMemory(name=desc.name, create=False)
        # Python < 3.13 registers attached segments too and would unlink the writer's
        # segment when this process exits; the writer owns it.
        if desc.name not in _OWNED:
            resource_tracker.unregister(self.shm._name, "shared_memory")  # type: ignore[attr-defined]
        self.ring = _ring_view(self.shm, desc.capacity_rows, desc.width, DTYPES[desc.dtype])
        self.opens = 1

    def read(self, offset: int, rows: int, inline: bytes = b"") -> torch.Tensor:
        if offset + rows > self.ring.shape[0]:
            raise ValueError(f"reference [{offset}, {offset + rows}) outside the ring")
        return self.ring[offset : offset + rows].clone()  # the slot may be reused once acknowledged

    def ring_on(self, device: torch.device) -> torch.Tensor | None:
        return self.ring if device.type == "cpu" else None

    def close(self) -> None:
        del self.ring
        self.shm.close()
