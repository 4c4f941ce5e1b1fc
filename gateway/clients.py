"""How the loop reaches the services: one long-lived bidi stream each (gRPC), or the
runtimes called in-process (the plain-loop baseline and tests). Same interface. Every step
has a timeout (TimeoutError past it), and a step in flight can be cut short from another
thread (`interrupt`: the liveness watch lost the service)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc

from specsplit.ops import DraftOp, DraftResult, StepTiming, TargetOp, TargetResult
from specsplit.transport import columns
from specsplit.transport.serving import channel_options
from specsplit.transport.step_client import BlockingSocketStream, SocketStream
from specsplit.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

# A client whose steps enforce the timeout they are given (its stream does), or never suspend (in
# process), sets `bounded_steps = True`: the loop then does not wrap its calls in asyncio.timeout.


Meanwhile = Callable[[], None] | None  # run once the request is sent, before the reply is read


class TargetClient(Protocol):
    async def step(self, ops: list[TargetOp], releases: Sequence[int], timeout: float, meanwhile: Meanwhile = None
                   ) -> tuple[list[TargetResult], StepTiming]: ...


class DraftClient(Protocol):
    async def step(self, ops: list[DraftOp], timeout: float, meanwhile: Meanwhile = None
                   ) -> tuple[list[DraftResult], StepTiming]: ...


class StepStream(Protocol):
    async def exchange(self, request: Any, timeout: float | None = None, meanwhile: Meanwhile = None) -> Any: ...

    async def send(self, request: Any) -> None: ...  # exchange in two halves: the request, then (receive)

    async def receive(self, request: Any, timeout: float | None = None) -> Any: ...  # its reply

    def reset(self) -> None: ...

    def interrupt(self) -> None: ...


class _BidiStream:
    """One open Step stream; requests and replies strictly alternate."""

    def __init__(self, open_call: Any) -> None:
        self.open_call, self.call = open_call, None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.interrupted = False

    async def exchange(self, request: Any, timeout: float | None = None, meanwhile: Meanwhile = None) -> Any:
        await self.send(request)
        if meanwhile is not None:
            meanwhile()
        return await self.receive(request, timeout)

    async def send(self, request: Any) -> None:
        if self.call is None:
            self.call, self.loop, self.interrupted = self.open_call(), asyncio.get_running_loop(), False
        try:
            await self.call.write(request)
        except BaseException:
            self.reset()
            raise

    async def receive(self, request: Any, timeout: float | None = None) -> Any:
        """The reply to `request`, sent before (send)."""
        if self.call is None:
            raise ConnectionError("stream reset before its reply")
        try:
            async with asyncio.timeout(timeout):  # not wait_for: no task per call, never swallows a cancel
                reply = await self.call.read()
        except asyncio.CancelledError:
            self.reset()
            if self.interrupted:
                raise ConnectionError("step interrupted: the service was lost") from None
            raise
        except BaseException:
            self.reset()
            raise
        if reply is grpc.aio.EOF:
            self.reset()
            raise ConnectionError("stream closed by the service")
        if reply.step_id != request.step_id:
            self.reset()
            raise ConnectionError(f"reply for step {reply.step_id}, expected {request.step_id}")
        return reply

    def reset(self) -> None:
        if self.call is not None:
            self.call.cancel()
        self.call = None

    def interrupt(self) -> None:
        call, loop = self.call, self.loop
        if call is not None and loop is not None and not loop.is_closed():
            self.interrupted = True
            loop.call_soon_threadsafe(call.cancel)


Blocking = tuple[float, float]  # a blocking step socket's (timeout, spin before each blocking read), seconds


def _stream(open_call: Any, socket_path: str, service: str, reply_type: type, blocking: Blocking | None
            ) -> StepStream:
    if socket_path and Path(socket_path).is_socket():
        if blocking is not None:
            return BlockingSocketStream(socket_path, service, reply_type, *blocking)
        return SocketStream(socket_path, service, reply_type)
    return _BidiStream(open_call)


def _transport_name(stream: StepStream) -> str:
    if isinstance(stream, BlockingSocketStream):
        return f"unix:{stream.path} (blocking on the loop thread, spinning {stream.spin_s * 1e6:.0f} µs first)"
    return f"unix:{stream.path}" if isinstance(stream, SocketStream) else "grpc stream"


class GrpcTarget:
    bounded_steps = True  # every stream enforces its step's timeout

    def __init__(self, addr: str, blocking: Blocking | None = None) -> None:
        """blocking: step sockets are read blocking, with this (timeout, spin) (only for a loop on
        a thread of its own, see BlockingSocketStream); None: asyncio streams."""
        self.blocking = blocking
        self.channel = grpc.aio.insecure_channel(addr, options=channel_options())
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        self.stream: StepStream = _BidiStream(self.stub.Step)
        self.ids = itertools.count(1)
        self.epoch = 0  # the lease its steps are sent under (gateway.liveness)

    async def describe(self, timeout: float = 10.0) -> target_pb2.TargetInfo:
        return await self.stub.Describe(target_pb2.TargetDescribeRequest(), timeout=timeout, wait_for_ready=True)

    def use_step_transport(self, socket_path: str) -> str:
        """Steps over the service's Unix socket when it advertises one this host can open (same
        messages, less per call), else over the gRPC stream; a fresh stream either way."""
        self.stream.reset()
        self.stream = _stream(self.stub.Step, socket_path, "target", target_pb2.TargetStepResponse,
                              self.blocking)
        return _transport_name(self.stream)

    async def step(self, ops: list[TargetOp], releases: Sequence[int], timeout: float, meanwhile: Meanwhile = None
                   ) -> tuple[list[TargetResult], StepTiming]:
        req = target_pb2.TargetStepRequest(step_id=next(self.ids), release_generations=list(releases), epoch=self.epoch)
        columns.write_target_step(req, ops)
        reply = await self.stream.exchange(req, timeout, meanwhile)
        return columns.target_results_from_proto(reply), StepTiming(reply.timing.compute_ms, reply.timing.total_ms)

    def interrupt(self) -> None:
        """Cut the step in flight short (any thread): it fails with ConnectionError."""
        self.stream.interrupt()

    async def close(self) -> None:
        self.stream.reset()
        await self.channel.close()


class GrpcDraft:
    bounded_steps = True

    def __init__(self, addr: str, blocking: Blocking | None = None) -> None:
        """blocking: step sockets are read blocking, with this (timeout, spin) (only for a loop on
        a thread of its own, see BlockingSocketStream); None: asyncio streams."""
        self.blocking = blocking
        self.channel = grpc.aio.insecure_channel(addr, options=channel_options())
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)
        self.stream: StepStream = _BidiStream(self.stub.Step)
        self.ids = itertools.count(1)
        self.epoch = 0  # the lease its steps are sent under (gateway.liveness)

    async def attach(self, store: Any, timeout: float = 10.0) -> draft_pb2.DraftInfo:
        return await self.stub.Attach(store, timeout=timeout)

    def use_step_transport(self, socket_path: str) -> str:
        self.stream.reset()
        self.stream = _stream(self.stub.Step, socket_path, "draft", draft_pb2.DraftStepResponse,
                              self.blocking)
        return _transport_name(self.stream)

    async def step(self, ops: list[DraftOp], timeout: float, meanwhile: Meanwhile = None
                   ) -> tuple[list[DraftResult], StepTiming]:
        req = self._request(ops)
        reply = await self.stream.exchange(req, timeout, meanwhile)
        return columns.draft_results_from_proto(reply), StepTiming(reply.timing.compute_ms, reply.timing.total_ms)

    async def send(self, ops: list[DraftOp]) -> Any:
        """A step in two halves (the draft computes while the caller does something else): the
        request sent; `receive` it before any other step."""
        req = self._request(ops)
        await self.stream.send(req)
        return req

    async def receive(self, sent: Any, timeout: float) -> tuple[list[DraftResult], StepTiming]:
        reply = await self.stream.receive(sent, timeout)
        return columns.draft_results_from_proto(reply), StepTiming(reply.timing.compute_ms, reply.timing.total_ms)

    def _request(self, ops: list[DraftOp]) -> draft_pb2.DraftStepRequest:
        req = draft_pb2.DraftStepRequest(step_id=next(self.ids), epoch=self.epoch)
        columns.write_draft_step(req, ops)
        return req

    def interrupt(self) -> None:
        """Cut the step in flight short (any thread): it fails with ConnectionError."""
        self.stream.interrupt()

    async def close(self) -> None:
        self.stream.reset()
        await self.channel.close()


class LocalTarget:
    """The target runtime called directly, in this process."""

    bounded_steps = True  # never suspends: a timeout could not interrupt it

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    async def step(self, ops: list[TargetOp], releases: Sequence[int], timeout: float = 0.0,
                   meanwhile: Meanwhile = None) -> tuple[list[TargetResult], StepTiming]:
        if meanwhile is not None:  # nothing overlaps an in-process step: before it
            meanwhile()
        t0 = time.perf_counter()
        results, timing = self.runtime.step(ops, list(releases))
        timing.total_ms = (time.perf_counter() - t0) * 1e3
        return results, timing


class LocalDraft:
    bounded_steps = True

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    async def step(self, ops: list[DraftOp], timeout: float = 0.0, meanwhile: Meanwhile = None
                   ) -> tuple[list[DraftResult], StepTiming]:
        if meanwhile is not None:
            meanwhile()
        return self.runtime.step(ops)

    async def send(self, ops: list[DraftOp]) -> list[DraftOp]:
        return ops  # computed when received: nothing overlaps in one process

    async def receive(self, sent: list[DraftOp], timeout: float = 0.0) -> tuple[list[DraftResult], StepTiming]:
        return self.runtime.step(sent)
