"""The server side of a long-lived Step stream, shared by the target and draft servicers
and by both step-socket servers: decode each batched request, run it on the engine, answer
in order."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import grpc

from specsplit.ops import Code, StepTiming
from specsplit.transport.serving import log
from specsplit.transport.wire import timing_to_proto

MAX_OPS_PER_STEP = 4096

StepRun = Callable[[list[Any], Any], tuple[list[Any], StepTiming]]  # (engine ops, request) -> results, timing
StepAfter = Callable[[list[Any], list[Any]], None]  # (ops, results): e.g. spans, recorded once the reply is out
Answered = tuple[Any, Callable[[], None] | None]  # the response, and what to do once it is sent


@dataclass
class StepCodec:
    decode_op: Callable[[Any], Any | None]  # proto op -> engine op (None: no known op set)
    write_result: Callable[[Any, Any], None]  # (proto result to fill, engine result)
    invalid_result: Callable[[int, Code, str], Any]  # engine result for an undecodable op
    response: Callable[..., Any]  # the response message class
    # the request's ops sent column by column, after its ops (ValueError: malformed)
    decode_columns: Callable[[Any], list[Any]] | None = None
    # (response to fill, engine results): every result, some as columns; None: write_result each
    write_results: Callable[[Any, list[Any]], None] | None = None


class StepAbort(Exception):
    """The stream ends with this status (a gRPC abort, or an error frame on a step socket)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def answer_step(req: Any, service: str, run: StepRun, codec: StepCodec, after: StepAfter | None = None
                ) -> Answered:
    """One request to its response, on the calling thread (the engine's), and `after` for the
    caller to run once the response is sent (`finish`): work the gateway need not wait for.
    Raises StepAbort; an engine failure is INTERNAL with its message, never a traceback. The
    response's timing.total_ms is the transport's to set (stamp_total)."""
    if len(req.ops) > MAX_OPS_PER_STEP:
        raise StepAbort(grpc.StatusCode.INVALID_ARGUMENT, f"more than {MAX_OPS_PER_STEP} ops in a step")
    ops, bad = [], []
    for p in req.ops:
        op = codec.decode_op(p)
        (ops.append(op) if op is not None else bad.append(p.seq_id))
    if codec.decode_columns is not None:
        try:
            ops += codec.decode_columns(req)
        except ValueError as e:
            raise StepAbort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed step: {e}") from None
        if len(ops) + len(bad) > MAX_OPS_PER_STEP:
            raise StepAbort(grpc.StatusCode.INVALID_ARGUMENT, f"more than {MAX_OPS_PER_STEP} ops in a step")
    try:
        results, timing = run(ops, req)
    except StepAbort:
        raise
    except Exception as e:
        log.exception("%s step failed", service)
        raise StepAbort(grpc.StatusCode.INTERNAL, f"{service} step failed: {type(e).__name__}: {e}") from None
    done = None if after is None else functools.partial(after, ops, list(results))
    results += [codec.invalid_result(s, Code.INVALID_ARGUMENT, "op has no known operation set") for s in bad]
    response = codec.response(step_id=req.step_id, timing=timing_to_proto(timing))
    if codec.write_results is not None:
        codec.write_results(response, results)
    else:
        for r in results:
            codec.write_result(response.results.add(), r)
    return response, done


def stamp_total(response: Any, received: float) -> None:
    """Set a response's timing.total_ms to the service's whole handling of its step: from the
    request's bytes read (perf_counter `received`) to the reply ready to send."""
    if response.HasField("timing"):
        response.timing.total_ms = (time.perf_counter() - received) * 1e3


def finish(done: Callable[[], None] | None, service: str) -> None:
    """Run a sent step's deferred work; its failure is logged, the stream goes on."""
    if done is None:
        return
    try:
        done()
    except Exception:  # noqa: BLE001 - spans are not worth a stream
        log.exception("%s: recording a step's spans failed", service)


async def serve_steps(request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext, service: str,
                      executor: Executor | None, run: StepRun, codec: StepCodec, after: StepAfter | None = None
                      ) -> AsyncIterator[Any]:
    """Each request is answered on `executor` (one thread: every TP rank must see the steps
    in one order), or on the event loop itself when `executor` is None (no thread hand-off,
    no GIL contention; health checks wait for the step)."""
    loop = asyncio.get_running_loop()
    async for req in request_iterator:
        received = time.perf_counter()
        try:
            if executor is None:
                reply, done = answer_step(req, service, run, codec, after)
            else:
                reply, done = await loop.run_in_executor(executor, answer_step, req, service, run, codec, after)
        except StepAbort as e:
            await context.abort(e.code, e.message)
        stamp_total(reply, received)
        yield reply
        finish(done, service)
