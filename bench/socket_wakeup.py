"""What a step-socket exchange costs when the service computes between messages, as a real
cycle's do: the services' StepSocketServer in a child process, whose engine busy-waits
--engine-us per step (as a thread waiting on its GPU does), and the gateway's blocking
client in this process, one exchange at a time, busy for as long again between calls (the
gateway's other service's step, during which this service waits for its next request).
With no compute the two threads trade messages while both still hold their CPUs; with
steps of a few milliseconds each side sits idle in a blocking read meanwhile, and the
message has to wake it. Reported: µs per call beyond the engine's time, with and without
spinning (polling before the blocking read) on either side, and the medians of its three
legs, timed on the clock both processes share (CLOCK_MONOTONIC): the request from the
client's send to the engine's start (`to_server_us`), the reply from the engine's end to
the client's read of its head returning (`to_client_us`), and the client reading the rest
and decoding it (`decode_us`). One JSON line per (engine time, server spin, client spin).

  python -m bench.socket_wakeup --engine-us 0,2000 --calls 1000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from specsplit.ops import StepTiming, TargetResult, Verify
from specsplit.transport import wire
from specsplit.transport.step_client import BlockingSocketStream
from specsplit.transport.step_socket import StepSocketServer
from specsplit.transport.step_stream import StepCodec, answer_step
from specsplit.v1 import target_pb2

_CODEC = StepCodec(wire.target_op_from_proto, wire.write_target_result, TargetResult, target_pb2.TargetStepResponse)


def _serve(path: str, engine_us: float, spin_us: float) -> None:
    def run(ops: list[Any], _req: Any) -> tuple[list[TargetResult], StepTiming]:
        started = time.perf_counter()
        _busy(engine_us)  # a thread waiting on its GPU spins (CUDA's default)
        stamps = f"{started!r} {time.perf_counter()!r}"  # the engine's window, for the client's split
        return [TargetResult(op.seq_id, message=stamps, tokens=[7], num_accepted=len(op.draft_ids))
                for op in ops], StepTiming()

    server = StepSocketServer(path, "target", target_pb2.TargetStepRequest,
                              lambda req: answer_step(req, "target", run, _CODEC), spin_s=spin_us * 1e-6).start()
    print("ready", flush=True)
    try:
        sys.stdin.read()  # until the parent closes the pipe
    finally:
        server.close()


def _busy(us: float) -> None:
    until = time.perf_counter() + us * 1e-6
    while time.perf_counter() < until:
        pass


def _measure(path: str, calls: int, client_spin_us: float, gap_us: float) -> tuple[float, dict[str, float]]:
    """µs per exchange, the gaps between exchanges not counted, and the medians of its legs."""
    stream = BlockingSocketStream(path, "target", target_pb2.TargetStepResponse, 60.0, client_spin_us * 1e-6)
    req = target_pb2.TargetStepRequest()
    wire.write_target_op(req.ops.add(), Verify(1, [100, 101, 102]))
    for i in range(50):  # warm-up
        req.step_id = i + 1
        stream.exchange_now(req)
    seen: list[float] = []  # when each read of the reply returned: the first is its head, seen
    read = stream._read_into

    def timed_read(buf: bytearray) -> bytes:
        out = read(buf)
        seen.append(time.perf_counter())
        return out

    stream._read_into = timed_read  # type: ignore[method-assign]
    spent = 0.0
    legs: list[tuple[float, float, float]] = []
    for i in range(calls):
        req.step_id = 100 + i
        _busy(gap_us)
        seen.clear()
        t0 = time.perf_counter()
        reply = stream.exchange_now(req)
        t1 = time.perf_counter()
        spent += t1 - t0
        started, ended = (float(x) for x in reply.results[0].status.message.split())
        legs.append((started - t0, seen[0] - ended, t1 - seen[0]))
    stream.reset()
    split = {name: round(statistics.median(leg[j] for leg in legs) * 1e6, 1)
             for j, name in enumerate(("to_server_us", "to_client_us", "decode_us"))}
    return spent * 1e6 / calls, split


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-us", default="0,2000", help="the service's compute per step, µs (comma list)")
    p.add_argument("--spin-us", type=float, default=20_000.0, help="how long a spinning side polls before blocking")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--server-engine-us", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--server-spin-us", type=float, default=0.0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        _serve(a.serve, a.server_engine_us, a.server_spin_us)
        return
    from bench.spec_vs_baseline import git_commit

    for engine_us in [float(x) for x in a.engine_us.split(",")]:
        for server_spin, client_spin in ((0.0, 0.0), (a.spin_us, 0.0), (0.0, a.spin_us), (a.spin_us, a.spin_us)):
            path = os.path.join(tempfile.mkdtemp(prefix="wakeup-"), "s.sock")
            proc = subprocess.Popen([sys.executable, "-m", "bench.socket_wakeup", "--serve", path,
                                     "--server-engine-us", str(engine_us), "--server-spin-us", str(server_spin)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
                us, split = _measure(path, a.calls, client_spin, engine_us)
            finally:
                proc.kill()
                proc.wait()
            print(json.dumps({"bench": "socket_wakeup", "engine_us": engine_us, "server_spin_us": server_spin,
                              "client_spin_us": client_spin, "us_per_call": round(us, 1),
                              "beyond_engine_us": round(us - engine_us, 1), **split, "calls": a.calls,
                              "commit": git_commit(), "machine": platform.machine(), "cpus": os.cpu_count()}),
                  flush=True)


if __name__ == "__main__":
    main()
