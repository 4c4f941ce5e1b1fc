"""The server side of a long-lived Step stream, shared by the target and draft servicers:
decode each batched request, run it on the engine thread, answer in order."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import grpc

from specsplit.ops import Code, StepTiming
from specsplit.serving import log
from specsplit.wire import timing_to_proto

MAX_OPS_PER_STEP = 4096


@dataclass
class StepCodec:
    decode_op: Callable[[Any], Any | None]  # proto op -> engine op (None: no known op set)
    encode_result: Callable[[Any], Any]  # engine result -> proto result
    invalid_result: Callable[[int, Code, str], Any]  # engine result for an undecodable op
    response: Callable[..., Any]  # the response message class


async def serve_steps(request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext, service: str,
                      executor: Executor | None, run: Callable[[list[Any], Any], tuple[list[Any], StepTiming]],
                      codec: StepCodec, after: Callable[[list[Any], list[Any]], None] | None = None
                      ) -> AsyncIterator[Any]:
    """`run(ops, request)` executes on `executor` (one thread: every TP rank must see the
    steps in one order), or on the event loop itself when `executor` is None (no thread
    hand-off, no GIL contention; health checks wait for the step); `after(ops, results)`
    runs on the event loop (e.g. spans)."""
    loop = asyncio.get_running_loop()
    async for req in request_iterator:
        t0 = time.perf_counter()
        if len(req.ops) > MAX_OPS_PER_STEP:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"more than {MAX_OPS_PER_STEP} ops in a step")
        ops, bad = [], []
        for p in req.ops:
            op = codec.decode_op(p)
            (ops.append(op) if op is not None else bad.append(p.seq_id))
        try:
            if executor is None:
                results, timing = run(ops, req)
            else:
                results, timing = await loop.run_in_executor(executor, run, ops, req)
        except Exception as e:  # never a traceback to the client
            log.exception("%s step failed", service)
            await context.abort(grpc.StatusCode.INTERNAL, f"{service} step failed: {type(e).__name__}: {e}")
        if after is not None:
            after(ops, results)
        results += [codec.invalid_result(s, Code.INVALID_ARGUMENT, "op has no known operation set") for s in bad]
        timing.total_ms = (time.perf_counter() - t0) * 1e3
        yield codec.response(step_id=req.step_id, results=[codec.encode_result(r) for r in results],
                             timing=timing_to_proto(timing))
