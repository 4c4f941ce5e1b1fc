"""The handoff interface and the ring allocator every ring-backed backend shares."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


@dataclass
class Allocation:
    offset: int
    rows: int
    generation: int
    inline: bytes = b""  # inline backend only


@dataclass
class Descriptor:
    backend: str
    name: str
    capacity_rows: int
    width: int
    dtype: str
    handle: bytes = b""  # cuda_ipc: the exported ring (see specsplit.transport.handoff.cuda_ipc); empty otherwise
    device: int = -1  # cuda_ipc: the writer's CUDA device index; -1 for the CPU backends


class RingAllocator:
    """Contiguous FIFO allocations in a ring of `capacity` rows.

    An allocation that would straddle the end starts again at row 0 (the tail is
    skipped). Releases may come in any order; space returns when every older
    allocation has been released too. A full ring answers None: backpressure.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.head = 0  # next free row
        self.live: deque[tuple[int, int, int]] = deque()  # (generation, start, end_incl_skip)
        self.released: set[int] = set()
        self.next_generation = 1
        self.used = 0  # rows held, skipped tails included

    def allocate(self, rows: int) -> Allocation | None:
        if rows <= 0 or rows > self.capacity:
            raise ValueError(f"cannot allocate {rows} rows in a ring of {self.capacity}")
        start, skip = self.head, 0
        if start + rows > self.capacity:  # wrap: skip the tail
            skip, start = self.capacity - start, 0
        if self.used + skip + rows > self.capacity:
            return None
        gen = self.next_generation
        self.next_generation += 1
        self.live.append((gen, start, skip + rows))
        self.used += skip + rows
        self.head = (start + rows) % self.capacity
        return Allocation(start, rows, gen)

    def release(self, generation: int) -> None:
        if not any(g == generation for g, _, _ in self.live):
            return  # unknown or already released: idempotent
        self.released.add(generation)
        while self.live and self.live[0][0] in self.released:
            gen, _, held = self.live.popleft()
            self.released.discard(gen)
            self.used -= held

    def release_all(self) -> None:
        """Every allocation back (their owner is gone); generations keep counting, so releases
        of the old ones are ignored."""
        self.live.clear()
        self.released.clear()
        self.head = self.used = 0

    @property
    def live_allocations(self) -> int:
        return len(self.live) - len(self.released)


class HiddenWriter(Protocol):
    """Target side (rank 0): allocate, write rows, release on acknowledgement."""

    descriptor: Descriptor
    allocator: RingAllocator

    def allocate(self, rows: int) -> Allocation | None: ...
    def write(self, alloc: Allocation, rows: torch.Tensor) -> None: ...
    def write_all(self, items: list[tuple[Allocation, torch.Tensor]]) -> None: ...  # a step's, complete at return
    def ring_on(self, device: torch.device) -> torch.Tensor | None: ...  # the ring, where `device` writes it in place
    def release(self, generation: int) -> None: ...
    def close(self) -> None: ...


class HiddenReader(Protocol):
    """Draft side: mapped once; reads the rows a reference points to. A read holds them until it
    is acknowledged, when the writer may reuse them: on a GPU it can be a view of the ring or a
    copy queued on the reader's current stream, so that stream must pass every use of it before
    the reply that acknowledges it. `ring_on(device)`: the ring itself [capacity, width] where
    `device` can read it in place (a CUDA graph gathers a step's rows from it), else None."""

    def read(self, offset: int, rows: int, inline: bytes = b"") -> torch.Tensor: ...
    def ring_on(self, device: torch.device) -> torch.Tensor | None: ...
    def close(self) -> None: ...
