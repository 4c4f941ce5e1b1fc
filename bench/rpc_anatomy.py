"""Where a service call's time goes outside the engine: the same bidi-stream exchange of a
TargetService Step, one request and one reply at a time, against three servers in a child
process, all with nothing to compute:
  - bare: a Step handler that echoes an empty reply (gRPC aio + uvloop, our server options);
  - framework: the services' own `serve_steps` (op decoding, result encoding, timing) over a
    runtime that returns at once, with steps on an engine thread (the default);
  - framework_inline: the same with steps on the event loop (`--inline-steps`);
  - socket: the services' Unix step socket (specsplit/transport/step_socket.py): the connection's
    own thread reads a request, steps and writes the reply;
  - socket_loop: the other design of a step socket, for comparison: the socket read on the
    event loop, the step handed to an engine thread and back.
The client is the gateway's own GrpcTarget (op encoding, the stream exchange, result
decoding), on its event loop; against the socket server also as the gateway's loop thread
runs it (`socket_blocking`: a blocking socket, no event-loop wake-up). Each call carries
`--batch` Verify ops of `--drafts` draft tokens (0: decodes, nothing captured). One JSON line:
µs per call for each server, and the differences.

  python -m bench.rpc_anatomy --calls 2000
  python -m bench.rpc_anatomy --calls 2000 --batch 32 --drafts 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from specsplit.ops import HiddenRef, StepTiming, TargetResult, Verify
from specsplit.transport import columns
from specsplit.transport.serving import install_uvloop, new_server
from specsplit.transport.step_socket import StepSocketServer
from specsplit.transport.step_stream import answer_step, serve_steps
from specsplit.v1 import target_pb2, target_pb2_grpc

MODES = ("bare", "framework", "framework_inline", "socket", "socket_loop")


class _Servicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.executor = ThreadPoolExecutor(max_workers=1) if mode in ("framework", "socket_loop") else None
        self.codec = columns.TARGET_CODEC  # the target service's

    @staticmethod
    def _run(ops: list[Any], _req: Any) -> tuple[list[TargetResult], StepTiming]:
        return [TargetResult(op.seq_id, tokens=[7], num_accepted=len(getattr(op, "draft_ids", [])),
                             hidden=HiddenRef(i, 1, i + 1) if getattr(op, "capture", False) else None)
                for i, op in enumerate(ops)], StepTiming(0.0, 0.0)

    def answer(self, req: Any) -> Any:
        return answer_step(req, "target", self._run, self.codec)

    async def Step(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        if self.mode == "bare":
            async for req in request_iterator:
                yield target_pb2.TargetStepResponse(step_id=req.step_id)
            return
        async for reply in serve_steps(request_iterator, context, "target", self.executor, self._run, self.codec):
            yield reply


def _socket_path(port: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"specsplit-rpc-anatomy-{port}.sock")


async def _serve(mode: str, port: int) -> None:
    server, _health = new_server()
    servicer = _Servicer(mode)
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    if mode == "socket":
        servicer.socket_server = StepSocketServer(_socket_path(port), "target", target_pb2.TargetStepRequest,
                                                  servicer.answer).start()
    elif mode == "socket_loop":  # keep a reference: an unreferenced server is closed when collected
        servicer.socket_server = await _loop_socket_server(_socket_path(port), servicer)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def _loop_socket_server(path: str, servicer: _Servicer) -> asyncio.AbstractServer:
    """The step socket as first built (same framing): read on the event loop, step on the engine thread."""
    loop = asyncio.get_running_loop()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        await reader.readline()  # the hello
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                (n,) = struct.unpack("<I", await reader.readexactly(4))
                req = target_pb2.TargetStepRequest.FromString(await reader.readexactly(n))
                reply = (await loop.run_in_executor(servicer.executor, servicer.answer, req))[0].SerializeToString()
                writer.write(struct.pack("<BI", 0, len(reply)) + reply)
                await writer.drain()
        writer.close()

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return await asyncio.start_unix_server(on_connection, path=path)


async def _client(port: int, calls: int, drafts: int, batch: int, socket: bool, blocking: bool = False) -> float:
    from gateway.clients import GrpcTarget

    target = GrpcTarget(f"127.0.0.1:{port}", (60.0, 0.0) if blocking else None)
    if socket:
        assert target.use_step_transport(_socket_path(port)).startswith("unix:")
    # a batch of greedy verifies (a decode of each sequence where drafts is 0, nothing captured)
    ops = [Verify(i + 1, list(range(100, 100 + drafts)), capture=drafts > 0) for i in range(batch)]
    for _ in range(50):  # warm-up: the stream opens, the first calls settle
        await target.step(ops, [], 10.0)
    t0 = time.perf_counter()
    for _ in range(calls):
        await target.step(ops, [], 10.0)
    us = (time.perf_counter() - t0) * 1e6 / calls
    await target.close()
    return us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--drafts", type=int, default=3, help="draft tokens in each Verify op of a call (0: decodes)")
    p.add_argument("--batch", type=int, default=1, help="Verify ops a call, one a sequence")
    p.add_argument("--port", type=int, default=50591)
    p.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    a = p.parse_args()
    install_uvloop()
    if a.serve:
        asyncio.run(_serve(a.serve, a.port))
        return
    out: dict[str, Any] = {"bench": "rpc_anatomy", "calls": a.calls, "drafts": a.drafts, "batch": a.batch}
    for i, mode in enumerate(MODES):
        port = a.port + i
        proc = subprocess.Popen([sys.executable, "-m", "bench.rpc_anatomy", "--serve", mode, "--port", str(port)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            us = asyncio.run(_client(port, a.calls, a.drafts, a.batch, mode.startswith("socket")))
            out[f"{mode}_us_per_call"] = round(us, 1)
            if mode == "socket":
                us = asyncio.run(_client(port, a.calls, a.drafts, a.batch, True, blocking=True))
                out["socket_blocking_us_per_call"] = round(us, 1)
        finally:
            proc.kill()
            proc.wait()
    out["framework_minus_bare_us"] = round(out["framework_us_per_call"] - out["bare_us_per_call"], 1)
    out["engine_thread_hop_us"] = round(out["framework_us_per_call"] - out["framework_inline_us_per_call"], 1)
    out["socket_over_grpc"] = round(out["socket_us_per_call"] / out["framework_us_per_call"], 3)
    out["socket_over_socket_loop"] = round(out["socket_us_per_call"] / out["socket_loop_us_per_call"], 3)
    out["socket_blocking_over_socket"] = round(out["socket_blocking_us_per_call"] / out["socket_us_per_call"], 3)
    from bench.spec_vs_baseline import git_commit

    out.update(commit=git_commit(), machine=platform.machine(), python=platform.python_version())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
