"""Two processes taking turns on one GPU, as the target and the draft do each cycle on a shared
GPU: process A's kernel (--a-us, a verify's graph) then process B's (--b-us, the draft's),
each side's host busy --host-us before each launch (packing its inputs). How the turn passes:

  sync     each side launches, waits for its kernel to finish, then messages the other, which
           launches on receipt: the services' handoff (a reply after the readback)
  event    each side launches, records an interprocess CUDA event and messages the other at
           once; the other makes its stream wait for that event and launches, so its host work
           and launch overlap the first side's kernel (as they could where a step reads the
           other side's results on the device, not from a message); a side runs at most --ahead
           cycles ahead of its own finished kernels (the readback it needs for its next message)
  one      both kernels on one stream of one process, the host work between launches (what the
           GPU alone allows)

Messages go over a socket pair, each side polling for them (the services' spinning sockets).
Reported per mode: µs a cycle, the two kernels' µs alone, and the GPU's idle µs a cycle (the
difference). Run it again with an MPS control daemon up (the line's "mps" says whether one
listens) to see what switching between the two processes' contexts costs.

  python -m bench.gpu_handoff --a-us 750 --b-us 240 --host-us 110 --cycles 2000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

MODES = ("sync", "event", "one")


def mps_daemon() -> bool:
    """Whether an MPS control daemon listens in this process's pipe directory
    (CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps): CUDA processes started from here then run
    as its clients."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))


def _busy(us: float) -> None:
    until = time.perf_counter() + us * 1e-6
    while time.perf_counter() < until:
        pass


def _recv(conn: Connection) -> bytes:
    while not conn.poll(0):  # spin, as the services' step sockets do on GPU stacks
        pass
    return conn.recv_bytes()


def _cycles_per_us(device: torch.device) -> float:
    """The GPU clock's cycles per µs as torch.cuda._sleep counts them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize(device)
    return 10_000_000 / (start.elapsed_time(end) * 1e3)


def _kernel_us(cycles: int, device: torch.device, reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) * 1e3 / reps


class Side:
    """One process's turn-taking: its kernel, its host work, its link to the other side."""

    def __init__(self, conn: Connection, cycles: int, host_us: float, ahead: int, device: torch.device) -> None:
        self.conn, self.cycles, self.host_us, self.ahead, self.device = conn, cycles, host_us, ahead, device
        self.stream = torch.cuda.current_stream(device)
        self.done = [torch.cuda.Event() for _ in range(ahead)]  # this side's finished turns, a ring

    def sync_turn(self) -> None:
        _busy(self.host_us)
        torch.cuda._sleep(self.cycles)
        torch.cuda.synchronize(self.device)
        self.conn.send_bytes(b"g")

    def open_events(self) -> None:
        """Trade interprocess events with the other side."""
        self.mine = torch.cuda.Event(interprocess=True)
        self.conn.send_bytes(bytes(self.mine.ipc_handle()))
        self.theirs = torch.cuda.Event.from_ipc_handle(self.device, _recv(self.conn))

    def event_turn(self, i: int, wait: bool) -> None:
        if i >= self.ahead:
            self.done[i % self.ahead].synchronize()  # this side's turn i - ahead has finished
        _busy(self.host_us)  # packing, while the other side's kernel runs
        if wait:
            _recv(self.conn)  # the other side has launched and recorded its event
            self.stream.wait_event(self.theirs)
        torch.cuda._sleep(self.cycles)
        self.mine.record(self.stream)
        self.done[i % self.ahead].record(self.stream)
        self.conn.send_bytes(b"g")


def _side_b(conn: Connection, mode: str, cycles: int, host_us: float, ahead: int, n: int) -> None:
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize(device)
    side = Side(conn, cycles, host_us, ahead, device)
    if mode == "event":
        side.open_events()
    conn.send_bytes(b"ready")
    for i in range(n):
        if mode == "sync":
            _recv(conn)
            side.sync_turn()
        else:
            side.event_turn(i, wait=True)
    torch.cuda.synchronize(device)
    conn.send_bytes(b"end")


def run_mode(mode: str, a: argparse.Namespace, per_us: float, device: torch.device) -> float:
    """µs a cycle of `mode`, over a.cycles cycles after a.warmup."""
    a_cycles, b_cycles = int(a.a_us * per_us), int(a.b_us * per_us)
    n = a.warmup + a.cycles
    t0 = 0.0
    if mode == "one":
        for i in range(n):
            if i == a.warmup:
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            _busy(a.host_us)
            torch.cuda._sleep(a_cycles)
            _busy(a.host_us)
            torch.cuda._sleep(b_cycles)
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e6 / a.cycles
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_side_b, args=(there, mode, b_cycles, a.host_us, a.ahead, n), daemon=True)
    child.start()
    try:
        side = Side(here, a_cycles, a.host_us, a.ahead, device)
        if mode == "event":
            side.open_events()
        assert _recv(here) == b"ready"
        for i in range(n):
            if i == a.warmup:
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            if mode == "sync":
                side.sync_turn()
                _recv(here)
            else:
                side.event_turn(i, wait=i > 0)
        if mode == "event":
            _recv(here)  # B's last launch
        assert _recv(here) == b"end"  # B's kernels have finished
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e6 / a.cycles
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a-us", type=float, default=750.0, help="process A's kernel, µs (a verify's graph)")
    p.add_argument("--b-us", type=float, default=240.0, help="process B's kernel, µs (the draft's graph)")
    p.add_argument("--host-us", type=float, default=110.0, help="each side's host work before a launch, µs")
    p.add_argument("--ahead", type=int, default=1, help="event mode: turns a side may launch past its last finished")
    p.add_argument("--cycles", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    a = p.parse_args()
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}: choose from {', '.join(MODES)}")
    if a.ahead < 1 or a.cycles < 1 or min(a.a_us, a.b_us, a.host_us) < 0:
        p.error("--ahead and --cycles must be at least 1, the µs figures not negative")
    if not torch.cuda.is_available():
        p.error("this bench times CUDA kernels: no CUDA device is visible")
    from bench.spec_vs_baseline import git_commit

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    per_us = _cycles_per_us(device)
    gpu_us = _kernel_us(int(a.a_us * per_us), device) + _kernel_us(int(a.b_us * per_us), device)
    for mode in modes:
        us = run_mode(mode, a, per_us, device)
        row: dict[str, Any] = {
            "bench": "gpu_handoff", "mode": mode, "a_us": a.a_us, "b_us": a.b_us, "host_us": a.host_us,
            "ahead": a.ahead if mode == "event" else None, "cycles": a.cycles,
            "us_per_cycle": round(us, 1), "kernels_us": round(gpu_us, 1), "gpu_idle_us": round(us - gpu_us, 1),
            "mps": mps_daemon(), "device": torch.cuda.get_device_name(device),
            "commit": git_commit(), "machine": platform.machine(),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
