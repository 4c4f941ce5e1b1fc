"""The CUDA IPC hidden-state ring: cross-process, cross-GPU, bitwise, mapped once."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import pytest
import torch

from specsplit.transport.handoff import RingAllocator, open_reader, open_writer

pytestmark = pytest.mark.gpu

TIMEOUT = 60  # seconds for any one control message


def needs_gpus(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA devices")


def int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _run_child(target, *args) -> dict:  # noqa: ANN001
    """Run target(*args, q) in a spawned process; return the dict it puts on q."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    try:
        out = q.get(timeout=TIMEOUT)
    finally:
        p.join(timeout=TIMEOUT)
        if p.is_alive():
            p.kill()
    assert "error" not in out, out["error"]
    return out


# -- children (module level so that spawn can import them)
def _read_child(desc, device: str, reads: list[tuple[int, int]], q) -> None:  # noqa: ANN001
    try:
        torch.zeros(1, device=device)  # the reader's own CUDA context, outside the open's time
        t0 = time.perf_counter()
        reader = open_reader(desc, device)
        open_s = time.perf_counter() - t0
        ptr, opens_before = reader.ring.data_ptr(), reader.opens
        got = []
        for offset, rows in reads:
            t = reader.read(offset, rows)
            assert t.device == torch.device(device)
            got.append(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        q.put({"rows": got, "open_s": open_s, "opens_before": opens_before, "opens_after": reader.opens,
               "same_mapping": reader.ring.data_ptr() == ptr})
        reader.close()
    except BaseException:  # noqa: BLE001
        q.put({"error": traceback.format_exc()})


def rows_for(cycle: int, max_rows: int) -> int:
    return 1 + (cycle * 2654435761 % 2**32) % max_rows


def bits_for(cycle: int, rows: int, width: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs and infinities included) for one cycle: both sides derive them."""
    g = torch.Generator().manual_seed(cycle)
    return torch.randint(-(2**15), 2**15, (rows, width), dtype=torch.int16, generator=g)


def _cycle_reader(desc, device: str, ref_q, ack_q, q) -> None:  # noqa: ANN001
    try:
        torch.zeros(1, device=device)
        t0 = time.perf_counter()
        reader = open_reader(desc, device)
        open_s = time.perf_counter() - t0
        peer = torch.cuda.can_device_access_peer(torch.device(device).index, desc.device)
        ptr = reader.ring.data_ptr()
        reads, mismatches, max_opens, read_s = 0, 0, reader.opens, []
        while (msg := ref_q.get(timeout=TIMEOUT)) is not None:
            cycle, offset, rows, gen = msg
            t1 = time.perf_counter()
            got = reader.read(offset, rows)
            read_s.append(time.perf_counter() - t1)
            ack_q.put(gen)  # acknowledge before checking: the slot may be overwritten from now on
            if not torch.equal(got.view(torch.int16).cpu(), bits_for(cycle, rows, desc.width)):
                mismatches += 1
            reads += 1
            max_opens = max(max_opens, reader.opens)
        first_read_us = read_s[0] * 1e6
        read_s.sort()
        q.put({"reads": reads, "mismatches": mismatches, "opens": reader.opens, "max_opens": max_opens,
               "same_mapping": reader.ring.data_ptr() == ptr, "open_s": open_s, "peer": peer,
               "first_read_us": first_read_us, "read_p50_us": read_s[len(read_s) // 2] * 1e6,
               "read_p99_us": read_s[int(len(read_s) * 0.99)] * 1e6})
        reader.close()
    except BaseException:  # noqa: BLE001
        q.put({"error": traceback.format_exc()})


# -- tests
@pytest.mark.quick
@needs_gpus(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_gpu_two_processes_bitwise(dtype: torch.dtype) -> None:
    writer = open_writer("cuda_ipc", 16, 12, dtype, device="cuda:0")
    try:
        rows = torch.randn(5, 12, device="cuda:0").to(dtype)
        rows[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
        first = writer.allocate(5)
        writer.write(first, rows)
        second = writer.allocate(7)
        writer.write(second, rows[:3].cpu())  # a CPU source works too, and may fill part of a slot
        out = _run_child(_read_child, writer.descriptor, "cuda:0", [(first.offset, 5), (second.offset, 3)])
        got = [torch.frombuffer(bytearray(b), dtype=dtype).view(-1, 12) for b in out["rows"]]
        assert torch.equal(int_view(got[0]), int_view(rows.cpu()))
        assert torch.equal(int_view(got[1]), int_view(rows[:3].cpu()))
        assert out["opens_after"] == 1
        print(f"\nsame GPU {dtype}: IPC open {out['open_s'] * 1e3:.1f} ms")
    finally:
        writer.close()


@needs_gpus(1)
def test_reads_never_open_again() -> None:
    writer = open_writer("cuda_ipc", 32, 64, torch.bfloat16, device="cuda:0")
    try:
        writer.write(writer.allocate(32), torch.randn(32, 64))
        reads = [(i % 29, 1 + i % 4) for i in range(500)]
        out = _run_child(_read_child, writer.descriptor, "cuda:0", reads)
        assert out["opens_before"] == out["opens_after"] == 1
        assert out["same_mapping"]
        assert len(out["rows"]) == 500
    finally:
        writer.close()


@needs_gpus(1)
def test_reader_in_the_writers_process_uses_the_ring_directly() -> None:
    writer = open_writer("cuda_ipc", 8, 6, torch.float32, device="cuda:0")
    try:
        rows = torch.randn(3, 6)
        alloc = writer.allocate(3)
        writer.write(alloc, rows)
        reader = open_reader(writer.descriptor, "cpu")
        assert torch.equal(reader.read(alloc.offset, 3), rows) and reader.opens == 1
        with pytest.raises(ValueError, match="outside the ring"):
            reader.read(6, 3)
        reader.close()
    finally:
        writer.close()


@needs_gpus(2)
def test_two_gpus_ten_thousand_cycles_with_wraparound() -> None:
    cycles, capacity, width, max_rows = 10_000, 64, 1536, 16
    writer = open_writer("cuda_ipc", capacity, width, torch.bfloat16, device="cuda:1")
    assert isinstance(writer.allocator, RingAllocator)
    ctx = mp.get_context("spawn")
    ref_q, ack_q, q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_cycle_reader, args=(writer.descriptor, "cuda:0", ref_q, ack_q, q))
    p.start()
    try:
        t0 = time.perf_counter()
        wraps, last_offset, in_flight = 0, -1, 0
        for cycle in range(cycles):
            rows = rows_for(cycle, max_rows)
            data = bits_for(cycle, rows, width).to("cuda:1").view(torch.bfloat16)
            while True:
                while in_flight and not ack_q.empty():
                    writer.release(ack_q.get_nowait())
                    in_flight -= 1
                alloc = writer.allocate(rows)
                if alloc is not None:
                    break
                writer.release(ack_q.get(timeout=TIMEOUT))  # backpressure: wait for the reader
                in_flight -= 1
            wraps += alloc.offset < last_offset
            last_offset = alloc.offset
            writer.write(alloc, data)
            ref_q.put((cycle, alloc.offset, rows, alloc.generation))
            in_flight += 1
        ref_q.put(None)
        out = q.get(timeout=TIMEOUT)
        elapsed = time.perf_counter() - t0
        assert "error" not in out, out["error"]
        print(f"\ntwo GPUs: {cycles} cycles in {elapsed:.2f} s, {wraps} wraps; first IPC open on the writer's GPU "
              f"{out['open_s'] * 1e3:.1f} ms; first read {out['first_read_us']:.1f} us; "
              f"read p50 {out['read_p50_us']:.1f} us, p99 {out['read_p99_us']:.1f} us; peer access {out['peer']}")
        assert out["reads"] == cycles and out["mismatches"] == 0
        assert out["opens"] == out["max_opens"] == 1 and out["same_mapping"]
        assert wraps > 100
    finally:
        p.join(timeout=TIMEOUT)
        if p.is_alive():
            p.kill()
        writer.close()
