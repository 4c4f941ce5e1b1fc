"""The admission-and-stream helper both Generate handlers use, without a server: the stream
limit, submission's status codes, the batching of tokens and release at the end."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from gateway.observe import NOOP_TRACER
from gateway.scheduler import Failed, Finished, GenerationRequest, QueueFull, Sequence, Unavailable
from gateway.stream import Admission, GenerateCall
from gateway.validation import InvalidRequest
from specsplit.ops import Sampling


class Aborted(Exception):
    pass


class Context:
    def invocation_metadata(self) -> tuple:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:4242"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class FakeScheduler:
    def __init__(self, events: list[Any], error: Exception | None = None) -> None:
        self.events, self.error, self.draft = events, error, object()
        self.cancelled: list[Sequence] = []
        self.tracer = NOOP_TRACER

    def submit(self, req: GenerationRequest, span: object) -> Sequence:
        if self.error is not None:
            raise self.error
        seq = Sequence(1, req)
        for e in self.events:
            seq.events.put_nowait(e)
        return seq

    def taken(self, seq: Sequence, n: int) -> None:
        seq.taken += n

    def cancel(self, seq: Sequence) -> None:
        self.cancelled.append(seq)


def request() -> GenerationRequest:
    return GenerationRequest([1, 2, 3], 8, Sampling(), set(), 3)


async def run(scheduler: FakeScheduler, interval: int, max_streams: int = 4) -> tuple[list[list[int]], Finished]:
    admission = Admission(scheduler, NOOP_TRACER, max_streams)  # type: ignore[arg-type]
    out = []
    try:
        async with admission.call(Context(), {}) as call:  # type: ignore[arg-type]
            await call.submit(await call.parse(request))
            async for tokens in call.tokens(interval):
                out.append(list(tokens))
            return out, call.finished
    finally:
        assert admission.streams == 0


@pytest.mark.parametrize("interval, batches", [(1, [[1], [2], [3, 4], [5]]), (3, [[1], [2, 3, 4], [5]]),
                                               (10, [[1], [2, 3, 4, 5]])])
def test_the_first_tokens_go_at_once_then_interval_at_a_time(interval: int, batches: list[list[int]]) -> None:
    scheduler = FakeScheduler([[1], [2], [3, 4], [5], Finished("length")])
    assert asyncio.run(run(scheduler, interval)) == (batches, Finished("length"))
    assert len(scheduler.cancelled) == 1  # released at the end (a no-op for a finished sequence)


@pytest.mark.parametrize("scheduler, code", [
    (FakeScheduler([[1], Failed(grpc.StatusCode.UNAVAILABLE, "target lost")]), grpc.StatusCode.UNAVAILABLE),
    (FakeScheduler([], QueueFull("queue full")), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (FakeScheduler([], Unavailable("target down")), grpc.StatusCode.UNAVAILABLE),
])
def test_failures_end_the_call_with_their_status(scheduler: FakeScheduler, code: grpc.StatusCode) -> None:
    with pytest.raises(Aborted) as e:
        asyncio.run(run(scheduler, 1))
    assert e.value.args[0] == code


def test_beyond_the_stream_limit_calls_are_refused() -> None:
    with pytest.raises(Aborted, match="more than 0 concurrent streams"):
        asyncio.run(run(FakeScheduler([Finished("stop")]), 1, max_streams=0))


def test_an_invalid_request_ends_the_call_with_invalid_argument() -> None:
    def bad() -> GenerationRequest:
        raise InvalidRequest("top_p must be in (0, 1], got 2.0")

    async def go() -> None:
        call = GenerateCall(FakeScheduler([]), NOOP_TRACER.start_span("x"), Context())  # type: ignore[arg-type]
        await call.parse(bad)

    with pytest.raises(Aborted) as e:
        asyncio.run(go())
    assert e.value.args == (grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1], got 2.0")
