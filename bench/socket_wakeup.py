"""What a step-socket exchange costs when the service computes between messages, as a real
cycle's do: the services' StepSocketServer in a child process, whose engine busy-waits
--engine-us per step (as a thread waiting on its GPU does), and the gateway's blocking
client in this process, one exchange at a time, busy for as long again between calls (the
gateway's other service's step, during which this service waits for its next request).
With no compute the two threads trade messages while both still hold their CPUs; with
steps of a few milliseconds each side sits idle in a blocking read meanwhile, and the
message has to wake it. Reported: µs per call beyond the engine's time, with and without
spinning (polling before the blocking read) on either side. One JSON line per (engine
time, server spin, client spin).

  python -m bench.socket_wakeup --engine-us 0,2000 --calls 1000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

from specsplit.ops import StepTiming, TargetResult, Verify
from specsplit.transport import wire
from specsplit.transport.step_socket import BlockingSocketStream, StepSocketServer
from specsplit.transport.step_stream import StepCodec, answer_step
from specsplit.v1 import target_pb2

_CODEC = StepCodec(wire.target_op_from_proto, wire.write_target_result, TargetResult, target_pb2.TargetStepResponse)


def _serve(path: str, engine_us: float, spin_us: float) -> None:
    def run(ops: list[Any], _req: Any) -> tuple[list[TargetResult], StepTiming]:
        _busy(engine_us)  # a thread waiting on its GPU spins (CUDA's default)
        return [TargetResult(op.seq_id, tokens=[7], num_accepted=len(op.draft_ids)) for op in ops], StepTiming()

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


def _measure(path: str, calls: int, client_spin_us: float, gap_us: float) -> float:
    """µs per exchange, the gaps between exchanges not counted."""
    stream = BlockingSocketStream(path, "target", target_pb2.TargetStepResponse, 60.0, client_spin_us * 1e-6)
    req = target_pb2.TargetStepRequest()
    wire.write_target_op(req.ops.add(), Verify(1, [100, 101, 102]))
    for i in range(50):  # warm-up
        req.step_id = i + 1
        stream.exchange_now(req)
    spent = 0.0
    for i in range(calls):
        req.step_id = 100 + i
        _busy(gap_us)
        t0 = time.perf_counter()
        stream.exchange_now(req)
        spent += time.perf_counter() - t0
    us = spent * 1e6 / calls
    stream.reset()
    return us


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
                us = _measure(path, a.calls, client_spin, engine_us)
            finally:
                proc.kill()
                proc.wait()
            print(json.dumps({"bench": "socket_wakeup", "engine_us": engine_us, "server_spin_us": server_spin,
                              "client_spin_us": client_spin, "us_per_call": round(us, 1),
                              "beyond_engine_us": round(us - engine_us, 1), "calls": a.calls,
                              "commit": git_commit(), "machine": platform.machine(), "cpus": os.cpu_count()}),
                  flush=True)


if __name__ == "__main__":
    main()
