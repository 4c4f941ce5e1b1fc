"""Rows carried inside the gRPC message: for a draft with no shared memory with the target."""

from __future__ import annotations

import torch

from specsplit.transport.handoff.base import DTYPES, Allocation, Descriptor, RingAllocator, dtype_name


class InlineWriter:
    def __init__(self, capacity_rows: int, width: int, dtype: torch.dtype) -> None:
        self.descriptor = Descriptor("inline", "", capacity_rows, width, dtype_name(dtype))
        self.allocator = RingAllocator(capacity_rows)  # bounds rows in flight, as the rings do
        self.dtype = dtype

    def allocate(self, rows: int) -> Allocation | None:
        return self.allocator.allocate(rows)

    def write(self, alloc: Allocation, rows: torch.Tensor) -> None:
        alloc.inline = rows.to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes()

    def write_all(self, items: list[tuple[Allocation, torch.Tensor]]) -> None:
        for alloc, rows in items:
            self.write(alloc, rows)

    def ring_on(self, device: torch.device) -> torch.Tensor | None:
        return None

    def release(self, generation: int) -> None:
        self.allocator.release(generation)

    def close(self) -> None:
        pass


class InlineReader:
    def __init__(self, desc: Descriptor) -> None:
        self.width, self.dtype = desc.width, DTYPES[desc.dtype]
        self.opens = 1

    def read(self, offset: int, rows: int, inline: bytes = b"") -> torch.Tensor:
        t = torch.frombuffer(bytearray(inline), dtype=self.dtype)
        if t.numel() != rows * self.width:
            raise ValueError(f"inline rows hold {t.numel()} values, expected {rows}x{self.width}")
        return t.view(rows, self.width)

    def ring_on(self, device: torch.device) -> torch.Tensor | None:
        return None  # the rows travel in the references

    def close(self) -> None:
        pass
