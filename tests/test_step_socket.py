"""The Step stream over a Unix socket (specsplit/transport/step_socket.py): the same messages and
servicer as the gRPC stream, its errors, its bounds, and the services using it."""

from __future__ import annotations

import asyncio
import os
import stat
import struct
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.ops import StepTiming, TargetResult, Verify
from specsplit.transport import step_socket, wire
from specsplit.transport.step_client import BlockingSocketStream, SocketStream
from specsplit.transport.step_socket import MAGIC, StepSocketError, StepSocketServer, check_step_socket
from specsplit.transport.step_stream import MAX_OPS_PER_STEP, StepCodec, answer_step
from specsplit.v1 import target_pb2

_CODEC = StepCodec(wire.target_op_from_proto, wire.write_target_result, TargetResult, target_pb2.TargetStepResponse)


class EchoServicer:
    """A target Step that accepts every draft (serve_steps over a runtime that computes nothing)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.threads: set[str] = set()  # where steps ran

    def _run(self, ops: list[Any], _req: Any) -> tuple[list[TargetResult], StepTiming]:
        self.threads.add(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("engine broke")
        return [TargetResult(op.seq_id, tokens=[*op.draft_ids, 7], num_accepted=len(op.draft_ids)) for op in ops], \
            StepTiming(0.5, 0.0)

    def answer(self, req: Any) -> Any:
        return answer_step(req, "target", self._run, _CODEC)


# the gateway's two clients of a step socket: on its event loop, or blocking on the loop thread
STREAMS = {"asyncio": lambda path: SocketStream(path, "target", target_pb2.TargetStepResponse),
           "blocking": lambda path: BlockingSocketStream(path, "target", target_pb2.TargetStepResponse, 10.0)}


@pytest.fixture(params=list(STREAMS))
def open_stream(request: pytest.FixtureRequest) -> Any:
    return STREAMS[request.param]


def request(step_id: int, drafts: list[int], ops: int = 1) -> target_pb2.TargetStepRequest:
    req = target_pb2.TargetStepRequest(step_id=step_id)
    for i in range(ops):
        wire.write_target_op(req.ops.add(), Verify(i + 1, drafts))
    return req


async def _with_server(path: Path, servicer: EchoServicer, body: Any) -> Any:
    server = StepSocketServer(path, "target", target_pb2.TargetStepRequest, servicer.answer).start()
    try:
        return await body()
    finally:
        server.close()


def test_exchange_carries_the_same_messages(open_stream: Any, tmp_path: Path) -> None:
    path = tmp_path / "t.sock"

    async def body() -> None:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        stream = open_stream(str(path))
        for i in range(1, 4):
            reply = await stream.exchange(request(i, [10, 11, i]))
            assert reply.step_id == i
            r = wire.target_result_from_proto(reply.results[0])
            assert r.seq_id == 1 and r.tokens == [10, 11, i, 7] and r.num_accepted == 3
            assert reply.timing.compute_ms == 0.5
        stream.reset()

    servicer = EchoServicer()
    asyncio.run(_with_server(path, servicer, body))
    assert not path.exists()  # removed at close
    assert servicer.threads == {"target-step-stream"}  # the connection's own thread ran the steps


def test_a_steps_spans_are_recorded_once_its_reply_is_out(open_stream: Any, tmp_path: Path) -> None:
    """The servicer's after-step work (its spans) runs once the reply is sent: a gateway never
    waits for it. Here step i's waits until the gateway has reply i, and records what it saw."""
    path = tmp_path / "t.sock"
    replied = {i: threading.Event() for i in (1, 2)}
    recorded: list[tuple[int, bool, int, int]] = []

    class Tracing(EchoServicer):
        def answer(self, req: Any) -> Any:
            def after(ops: list[Any], results: list[Any], i: int = req.step_id) -> None:
                recorded.append((i, replied[i].wait(10.0), len(ops), len(results)))

            return answer_step(req, "target", self._run, _CODEC, after)

    async def body() -> None:
        stream = open_stream(str(path))
        for i in (1, 2):
            reply = await stream.exchange(request(i, [10, 11], ops=2))
            assert reply.step_id == i
            replied[i].set()
        stream.reset()

    asyncio.run(_with_server(path, Tracing(), body))
    assert recorded[:1] == [(1, True, 2, 2)] and recorded[1:] in ([], [(2, True, 2, 2)])  # the close may cut the last


def test_close_ends_open_streams(open_stream: Any, tmp_path: Path) -> None:
    path = tmp_path / "t.sock"
    server = StepSocketServer(path, "target", target_pb2.TargetStepRequest, EchoServicer().answer).start()

    async def body() -> None:
        stream = open_stream(str(path))
        assert (await stream.exchange(request(1, [5]))).step_id == 1
        server.close()
        with pytest.raises(ConnectionError):
            await stream.exchange(request(2, [5]))
        with pytest.raises(OSError):  # and nothing listens any more
            await stream.exchange(request(3, [5]))

    asyncio.run(body())
    assert not path.exists()


def test_streams_over_the_limit_are_refused(open_stream: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_socket, "MAX_CONNECTIONS", 1)
    path = tmp_path / "t.sock"

    async def body() -> None:
        first = open_stream(str(path))
        assert (await first.exchange(request(1, [5]))).step_id == 1
        second = open_stream(str(path))
        with pytest.raises(StepSocketError) as e:
            await second.exchange(request(1, [5]))
        assert e.value.code == "RESOURCE_EXHAUSTED"
        assert (await first.exchange(request(2, [5]))).step_id == 2  # the open stream is unaffected
        first.reset()
        for _ in range(100):  # once the first is gone, its slot is free again
            await asyncio.sleep(0.01)
            try:
                assert (await second.exchange(request(3, [5]))).step_id == 3
                return
            except StepSocketError:
                pass
        raise AssertionError("the freed slot was not reused")

    asyncio.run(_with_server(path, EchoServicer(), body))


def test_aborts_become_errors_and_the_stream_reopens(open_stream: Any, tmp_path: Path) -> None:
    path = tmp_path / "t.sock"

    async def body() -> None:
        stream = open_stream(str(path))
        with pytest.raises(StepSocketError) as e:
            await stream.exchange(request(1, [], ops=MAX_OPS_PER_STEP + 1))
        assert e.value.code == "INVALID_ARGUMENT" and "more than" in e.value.message
        assert (await stream.exchange(request(2, [5]))).step_id == 2  # a new connection

    asyncio.run(_with_server(path, EchoServicer(), body))


def test_engine_failure_is_internal_without_traceback(open_stream: Any, tmp_path: Path) -> None:
    path = tmp_path / "t.sock"

    async def body() -> None:
        stream = open_stream(str(path))
        with pytest.raises(StepSocketError) as e:
            await stream.exchange(request(1, [1]))
        assert e.value.code == grpc.StatusCode.INTERNAL.name
        assert e.value.message == "target step failed: RuntimeError: engine broke"

    asyncio.run(_with_server(path, EchoServicer(fail=True), body))


def test_a_server_bug_ends_the_stream_with_internal(open_stream: Any, tmp_path: Path) -> None:
    path = tmp_path / "t.sock"

    def broken_answer(_req: Any) -> Any:
        raise KeyError("oops")

    server = StepSocketServer(path, "target", target_pb2.TargetStepRequest, broken_answer).start()

    async def body() -> None:
        stream = open_stream(str(path))
        with pytest.raises(StepSocketError) as e:
            await stream.exchange(request(1, [5]))
        assert e.value.code == "INTERNAL" and e.value.message == "target step socket failed: KeyError"

    try:
        asyncio.run(body())
    finally:
        server.close()


def test_a_blocking_stream_times_out_and_reconnects(tmp_path: Path) -> None:
    path = tmp_path / "t.sock"
    slow = threading.Event()

    def answer(req: Any) -> Any:
        if slow.is_set():
            threading.Event().wait(1.0)  # longer than the client's timeout
        return EchoServicer().answer(req)

    server = StepSocketServer(path, "target", target_pb2.TargetStepRequest, answer).start()
    try:
        stream = BlockingSocketStream(str(path), "target", target_pb2.TargetStepResponse, 0.2)
        assert stream.exchange_now(request(1, [5])).step_id == 1
        slow.set()
        with pytest.raises(TimeoutError, match="target step took longer than 0.2 s"):
            stream.exchange_now(request(2, [5]))
        assert stream.sock is None  # the stream is dropped: a late reply cannot be taken for the next step's
        slow.clear()
        assert stream.exchange_now(request(3, [5])).step_id == 3  # on a new connection
    finally:
        server.close()


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
        cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), num_steps=3, threads=1, log_dir=logs,
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


def test_spinning_sides_exchange_the_same_messages(tmp_path: Path) -> None:
    """A server and a client that poll before their blocking reads (--step-socket-spin-us,
    --step-spin-us) carry the same replies, also across a gap longer than the spin."""
    path = tmp_path / "t.sock"
    server = StepSocketServer(path, "target", target_pb2.TargetStepRequest, EchoServicer().answer,
                              spin_s=0.05).start()
    try:
        stream = BlockingSocketStream(str(path), "target", target_pb2.TargetStepResponse, 10.0, spin_s=0.05)
        for i in range(1, 4):
            reply = stream.exchange_now(request(i, [10, i]))
            assert reply.step_id == i and wire.target_result_from_proto(reply.results[0]).tokens == [10, i, 7]
            if i == 2:
                threading.Event().wait(0.1)  # past the server's spin: it blocks, and still answers
    finally:
        server.close()


def test_spin_settings_are_checked() -> None:
    from draft_service.config import DraftConfig
    from gateway.config import GatewayConfig
    from target_service.config import TargetConfig

    assert step_socket.resolve_spin_s(-1.0, on_gpu=True) == 0.02  # automatic: spin on GPU stacks
    assert step_socket.resolve_spin_s(-1.0, on_gpu=False) == 0.0  # and not where the CPU computes
    assert step_socket.resolve_spin_s(500.0, on_gpu=False) == 0.0005
    for bad in (-2.0, 2e6):
        with pytest.raises(ValueError, match="spin of"):
            TargetConfig(step_socket_spin_us=bad).validate()
        with pytest.raises(ValueError, match="spin of"):
            DraftConfig(step_socket_spin_us=bad).validate()
        with pytest.raises(ValueError, match="spin of"):
            GatewayConfig(step_spin_us=bad).validate()
