"""The Step stream over a Unix socket (specsplit/step_socket.py): the same messages and
servicer as the gRPC stream, its errors, its bounds, and the services using it."""

from __future__ import annotations

import asyncio
import os
import stat
import struct
from pathlib import Path
from typing import Any

import grpc
import pytest

from specsplit import wire
from specsplit.client import GatewayClient, make_request
from specsplit.launcher import ServiceStack, StackConfig
from specsplit.ops import StepTiming, TargetResult, Verify
from specsplit.step_socket import (
    MAGIC,
    SocketStream,
    StepSocketError,
    check_step_socket,
    close_step_socket,
    start_step_socket,
)
from specsplit.step_stream import MAX_OPS_PER_STEP, StepCodec, serve_steps
from specsplit.v1 import target_pb2

_CODEC = StepCodec(wire.target_op_from_proto, wire.target_result_to_proto, TargetResult, target_pb2.TargetStepResponse)


class EchoServicer:
    """A target Step that accepts every draft (serve_steps over a runtime that computes nothing)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def _run(self, ops: list[Any], _req: Any) -> tuple[list[TargetResult], StepTiming]:
        if self.fail:
            raise RuntimeError("engine broke")
        return [TargetResult(op.seq_id, tokens=[*op.draft_ids, 7], num_accepted=len(op.draft_ids)) for op in ops], \
            StepTiming(0.5, 0.0)

    async def Step(self, requests: Any, context: Any) -> Any:  # noqa: N802
        async for reply in serve_steps(requests, context, "target", None, self._run, _CODEC):
            yield reply


def request(step_id: int, drafts: list[int], ops: int = 1) -> target_pb2.TargetStepRequest:
    return target_pb2.TargetStepRequest(step_id=step_id, ops=[wire.target_op_to_proto(Verify(i + 1, drafts))
                                                              for i in range(ops)])


async def _with_server(path: Path, servicer: EchoServicer, body: Any) -> Any:
    server = await start_step_socket(path, "target", target_pb2.TargetStepRequest, servicer.Step)
    try:
        return await body()
    finally:
        close_step_socket(server, path)


def test_exchange_carries_the_same_messages(tmp_path: Path) -> None:
    path = tmp_path / "t.sock"

    async def body() -> None:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        stream = SocketStream(str(path), "target", target_pb2.TargetStepResponse)
        for i in range(1, 4):
            reply = await stream.exchange(request(i, [10, 11, i]))
            assert reply.step_id == i
            r = wire.target_result_from_proto(reply.results[0])
            assert r.seq_id == 1 and r.tokens == [10, 11, i, 7] and r.num_accepted == 3
            assert reply.timing.compute_ms == 0.5
        stream.reset()

    asyncio.run(_with_server(path, EchoServicer(), body))
    assert not path.exists()  # removed at close


def test_aborts_become_errors_and_the_stream_reopens(tmp_path: Path) -> None:
    path = tmp_path / "t.sock"

    async def body() -> None:
        stream = SocketStream(str(path), "target", target_pb2.TargetStepResponse)
        with pytest.raises(StepSocketError) as e:
            await stream.exchange(request(1, [], ops=MAX_OPS_PER_STEP + 1))
        assert e.value.code == "INVALID_ARGUMENT" and "more than" in e.value.message
        assert (await stream.exchange(request(2, [5]))).step_id == 2  # a new connection

    asyncio.run(_with_server(path, EchoServicer(), body))


def test_engine_failure_is_internal_without_traceback(tmp_path: Path) -> None:
    path = tmp_path / "t.sock"

    async def body() -> None:
        stream = SocketStream(str(path), "target", target_pb2.TargetStepResponse)
        with pytest.raises(StepSocketError) as e:
            await stream.exchange(request(1, [1]))
        assert e.value.code == grpc.StatusCode.INTERNAL.name
        assert e.value.message == "target step failed: RuntimeError: engine broke"

    asyncio.run(_with_server(path, EchoServicer(fail=True), body))


@pytest.mark.parametrize("case", ["wrong_hello", "oversize", "garbage"])
def test_bad_streams_are_refused(tmp_path: Path, case: str) -> None:
    path = tmp_path / "t.sock"

    async def body() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_unix_connection(str(path))
        if case == "wrong_hello":
            writer.write(MAGIC + b"draft\n")  # a draft client at the target's door
        else:
            writer.write(MAGIC + b"target\n")
            writer.write(struct.pack("<I", 1 << 30) if case == "oversize" else struct.pack("<I", 3) + b"\xff\xff\xff")
        kind, n = struct.unpack("<BI", await reader.readexactly(5))
        payload = await reader.readexactly(n)
        assert await reader.read() == b""  # then the server closes
        writer.close()
        return kind, payload

    kind, payload = asyncio.run(_with_server(path, EchoServicer(), body))
    code = {"wrong_hello": "INVALID_ARGUMENT", "oversize": "RESOURCE_EXHAUSTED", "garbage": "INVALID_ARGUMENT"}[case]
    assert kind == 1 and payload.decode().startswith(code + "\t")


def test_socket_paths_are_checked(tmp_path: Path) -> None:
    check_step_socket("")
    check_step_socket(str(tmp_path / "ok.sock"))
    with pytest.raises(ValueError, match="does not exist"):
        check_step_socket(str(tmp_path / "missing" / "t.sock"))
    with pytest.raises(ValueError, match="longer than"):
        check_step_socket(str(tmp_path / ("x" * 120)))
    (tmp_path / "file").write_text("not a socket")
    with pytest.raises(ValueError, match="not a socket"):
        check_step_socket(str(tmp_path / "file"))


def test_services_step_over_sockets_with_the_same_tokens(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    outputs = {}
    for sockets in (True, False):
        logs = tmp_path / f"logs-{sockets}"
        cfg = StackConfig(model=str(tiny_target), head=str(tiny_head), num_steps=3, threads=1, log_dir=logs,
                          step_sockets=sockets)
        with ServiceStack(cfg) as stack:
            client = GatewayClient(stack.addr("gateway"))
            outputs[sockets] = [client.generate(make_request(token_ids=p, max_new_tokens=24, ignore_eos=True)).token_ids
                                for p in ([1, 2, 3], [9, 8, 7, 6])]
            client.close()
            socket_dir = stack.socket_dir
        gateway_log = (logs / "gateway.log").read_text()
        transport = "unix:" if sockets else "grpc stream"
        assert f"target steps over {transport}" in gateway_log and f"draft steps over {transport}" in gateway_log
        if sockets:
            assert socket_dir is not None and not Path(socket_dir).exists()  # removed by stop()
    assert outputs[True] == outputs[False] and all(len(o) == 24 for o in outputs[True])
