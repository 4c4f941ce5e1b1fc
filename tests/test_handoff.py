"""The hidden-state ring: allocation, backpressure, reclamation, and cross-process reads."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from specsplit.transport import wire
from specsplit.transport.handoff import RingAllocator, open_reader, open_writer
from specsplit.transport.handoff.base import Descriptor
from specsplit.transport.handoff.factory import BACKENDS
from specsplit.v1 import common_pb2


def test_ring_wraps_and_skips_the_tail() -> None:
    ring = RingAllocator(10)
    a = ring.allocate(6)
    b = ring.allocate(3)
    assert (a.offset, b.offset) == (0, 6)
    assert ring.allocate(2) is None  # 1 row left at the tail, head not free: backpressure
    ring.release(a.generation)
    c = ring.allocate(2)  # skips row 9, wraps to 0
    assert c is not None and c.offset == 0
    assert ring.used == 3 + 1 + 2


def test_release_out_of_order_reclaims_only_when_older_are_released() -> None:
    ring = RingAllocator(8)
    a, b, c = ring.allocate(2), ring.allocate(2), ring.allocate(2)
    ring.release(b.generation)
    assert ring.used == 6  # a still holds the head
    ring.release(a.generation)
    assert ring.used == 2
    ring.release(c.generation)
    ring.release(c.generation)  # idempotent
    assert ring.used == 0 and ring.live_allocations == 0


def test_full_ring_is_backpressure_never_overwrite() -> None:
    ring = RingAllocator(4)
    allocs = [ring.allocate(1) for _ in range(4)]
    assert all(allocs) and ring.allocate(1) is None
    with pytest.raises(ValueError):
        ring.allocate(5)


def _reader_proc(desc, offset: int, rows: int, q) -> None:  # noqa: ANN001
    reader = open_reader(desc)
    q.put(reader.read(offset, rows).tolist())
    reader.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shm_rows_cross_processes_bitwise(dtype: torch.dtype) -> None:
    writer = open_writer("shm", 16, 12, dtype)
    try:
        rows = torch.randn(5, 12).to(dtype)
        alloc = writer.allocate(5)
        writer.write(alloc, rows)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_reader_proc, args=(writer.descriptor, alloc.offset, 5, q))
        p.start()
        got = torch.tensor(q.get(timeout=60), dtype=dtype)
        p.join(timeout=30)
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           rows.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        # the writer's segment survives the reader's exit
        assert open_reader(writer.descriptor).read(alloc.offset, 5).shape == (5, 12)
    finally:
        writer.close()


def test_inline_backend_round_trip() -> None:
    writer = open_writer("inline", 8, 6, torch.float32)
    rows = torch.randn(3, 6)
    alloc = writer.allocate(3)
    writer.write(alloc, rows)
    reader = open_reader(writer.descriptor)
    assert torch.equal(reader.read(alloc.offset, 3, alloc.inline), rows)


def test_unknown_backend_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown hidden-state backend"):
        open_writer("carrier-pigeon", 8, 6, torch.float32)


@pytest.mark.parametrize("desc", [
    Descriptor("shm", "specsplit-abc", 16, 12, "float32"),
    Descriptor("cuda_ipc", "specsplit-cuda-abc", 64, 1536, "bfloat16", handle=b'{"version": 1}\x00\xff', device=0),
    Descriptor("cuda_ipc", "specsplit-cuda-abc", 64, 1536, "bfloat16", handle=b"x", device=3),
])
def test_descriptor_round_trips_through_the_proto(desc: Descriptor) -> None:
    p = common_pb2.HiddenStoreDescriptor.FromString(wire.descriptor_to_proto(desc).SerializeToString())
    assert wire.descriptor_from_proto(p) == desc


def test_cuda_ipc_needs_a_cuda_device() -> None:
    assert "cuda_ipc" in BACKENDS
    with pytest.raises(ValueError, match="needs a CUDA device"):
        open_writer("cuda_ipc", 8, 6, torch.float32, device="cpu")
