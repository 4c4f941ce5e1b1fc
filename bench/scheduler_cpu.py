"""The gateway's scheduler on its own: CPU per cycle with stub engines that answer at once
(no sockets, no gRPC, no processes), so what is measured is the loop's Python — admission,
spans, op building, applying results, emitting tokens. Every draft is accepted (τ =
num_steps + 1). With `--tracing`, every request sampled and every cycle traced: the SDK's
spans exported in this process (`sdk`) against the gateway's span records exported by their
child process (`records`), jsonl files in a temporary folder. With `--engine-us`, each call
computes that long, and the loop's work between sending a request and reading its reply (the
readers' events, gateway.outbox) overlaps it, or not (`--overlap off`): what a cycle spends
beyond its calls' compute. With `--decode-ahead-ms`, cycles that draft nothing decode ahead
(gateway.phases.decode_ahead; the stub target decodes as many tokens as asked), and the report's
cpu_us_per_token_step is the loop's CPU per token of every sequence. One JSON line per batch size
and setting.

  python -m bench.scheduler_cpu --cycles 20000 --batch 1,8 --tracing off,sdk,records
  python -m bench.scheduler_cpu --cycles 5000 --batch 1,8 --engine-us 500 --overlap off,on
  python -m bench.scheduler_cpu --cycles 5000 --batch 1,8 --num-steps 0 --decode-ahead-ms 0,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import select
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from bench.spec_vs_baseline import git_commit
from gateway.clients import Meanwhile
from gateway.observe import NOOP_TRACER, CycleSpans
from gateway.scheduler import Finished, GenerationRequest, Limits, Scheduler, Sequence
from specsplit.observability.spans import ShippingProcessor, SpanLog, traceparent
from specsplit.observability.telemetry import span_exporter
from specsplit.ops import (
    DraftOp,
    DraftResult,
    ExtendPropose,
    HiddenRef,
    Prefill,
    Recapture,
    Release,
    Resume,
    Sampling,
    StepTiming,
    Suspend,
    TargetOp,
    TargetResult,
    Verify,
)
from specsplit.transport.serving import install_uvloop


def engine(us: float, meanwhile: Meanwhile, overlap: bool = True) -> None:
    """A service's compute of `us` µs, which the gateway's `meanwhile` work overlaps (with
    `overlap` off the compute starts after it), waited for as the gateway's spinning step socket
    does: polling, the GIL released at each poll."""
    until = time.perf_counter() + us * 1e-6
    if meanwhile is not None:
        meanwhile()
    if not overlap:
        until = time.perf_counter() + us * 1e-6
    while time.perf_counter() < until:
        _IDLE.poll(0)


_IDLE = select.poll()  # polled by a waiting engine() (a pipe that never becomes readable)
_IDLE.register(os.pipe()[0], select.POLLIN)


class InstantTarget:
    """Accepts every draft (none with `accept=False`) and adds token 9. `suspend`: yield to the event
    loop once, as a client doing I/O does (the in-process clients do not); `hang`: never answer,
    from the next call on (for timeout tests)."""

    def __init__(self, suspend: bool = True, accept: bool = True, engine_us: float = 0.0, overlap: bool = True
                 ) -> None:
        self.generation, self.hang, self.suspend, self.accept = 0, False, suspend, accept
        self.engine_us, self.overlap, self.calls = engine_us, overlap, 0

    @property
    def bounded_steps(self) -> bool:  # as the gateway's real clients, unless it hangs (gateway.clients)
        return not self.hang

    async def step(self, ops: list[TargetOp], releases: list[int], timeout: float = 0.0,
                   meanwhile: Meanwhile = None) -> tuple[list[TargetResult], StepTiming]:
        hang = self.hang  # as bounded_steps said before this call
        engine(self.engine_us, meanwhile, self.overlap)
        self.calls += 1
        if self.suspend:
            await asyncio.sleep(0)  # a real client suspends for its I/O (the in-process ones do not)
        if hang:
            await asyncio.Event().wait()
        out = []
        for op in ops:
            if isinstance(op, Release | Suspend):
                continue
            self.generation += 1
            if isinstance(op, Recapture | Resume):  # features for a draft restarting at position 0
                out.append(TargetResult(op.seq_id, tokens=[9, 9], hidden=HiddenRef(0, 2, self.generation)))
                continue
            if isinstance(op, Verify) and op.decode > 1:  # decoded ahead: no drafts, nothing captured
                out.append(TargetResult(op.seq_id, tokens=[9] * op.decode))
                continue
            tokens = [*op.draft_ids, 9] if isinstance(op, Verify) and self.accept else [9]
            if isinstance(op, Prefill) and op.more:  # a part of a prompt with more to come: no token yet
                tokens = []
            out.append(TargetResult(op.seq_id, tokens=tokens, num_accepted=len(tokens) - 1,
                                    hidden=HiddenRef(0, len(tokens), self.generation)))
        return out, StepTiming()


class InstantDraft:
    """Proposes 1, 2, ... num_steps; hangs when `hang` is set."""

    def __init__(self, suspend: bool = True, engine_us: float = 0.0, overlap: bool = True) -> None:
        self.hang, self.suspend, self.engine_us, self.overlap, self.calls = False, suspend, engine_us, overlap, 0

    @property
    def bounded_steps(self) -> bool:
        return not self.hang

    async def step(self, ops: list[DraftOp], timeout: float = 0.0, meanwhile: Meanwhile = None
                   ) -> tuple[list[DraftResult], StepTiming]:
        hang = self.hang
        engine(self.engine_us, meanwhile, self.overlap)
        self.calls += 1
        if self.suspend:
            await asyncio.sleep(0)
        if hang:
            await asyncio.Event().wait()
        return [DraftResult(op.seq_id, draft_ids=list(range(1, op.num_steps + 1)))
                for op in ops if isinstance(op, ExtendPropose)], StepTiming()


class SdkCycleSpans(CycleSpans):
    """The cycles' spans as the OpenTelemetry SDK's own, built and exported in this process (the
    baseline the span records of gateway.observe are measured against)."""

    def __init__(self, tracer: trace.Tracer) -> None:
        super().__init__(None)
        self.tracer = tracer

    def open(self, running: list[Sequence], newcomers: list[Sequence]) -> list[Sequence]:
        for s in running:
            s.cycle_span = self.tracer.start_span(
                "prefill" if s in newcomers else "cycle", context=trace.set_span_in_context(s.span),
                attributes={"spec.cycle": 0 if s in newcomers else s.stats.cycles + 1, "spec.batch_size": len(running),
                            "spec.num_steps": s.req.num_steps if s.spec else 0, "spec.seq_id": s.seq_id,
                            "spec.topk": s.req.topk})
            ctx = s.cycle_span.get_span_context()
            s.trace = traceparent(ctx.trace_id, ctx.span_id)
        return list(running)


def tracer_for(mode: str, folder: str) -> tuple[trace.Tracer, SpanLog | None, TracerProvider | None]:
    """off: no tracing; sdk: the SDK's spans, exported (jsonl into `folder`) by its batch processor
    in this process; records: the gateway's span records, exported by their child process."""
    if mode == "off":
        return NOOP_TRACER, None, None
    os.environ.update({"OTEL_TRACES_EXPORTER": "jsonl", "SPECSPLIT_TRACE_DIR": folder})
    provider = TracerProvider()
    if mode == "sdk":
        provider.add_span_processor(BatchSpanProcessor(span_exporter("specsplit-gateway", os.getpid())))
        return provider.get_tracer("specsplit"), None, provider
    spans = SpanLog("specsplit-gateway")
    provider.add_span_processor(ShippingProcessor(spans))
    return provider.get_tracer("specsplit"), spans, provider


async def measure(batch: int, cycles: int, num_steps: int, tracing: str = "off", adaptive: bool = False,
                  accept: bool = True, engine_us: float = 0.0, loop_thread: bool = False, overlap: bool = True,
                  decode_ahead_ms: float = 0.0) -> dict:
    """`loop_thread`: the scheduler on an event loop of its own thread, as the gateway runs it, its
    readers (the streams' stand-ins) on this one; else both on this loop."""
    with tempfile.TemporaryDirectory(prefix="scheduler-cpu-") as folder:
        tracer, spans, provider = tracer_for(tracing, folder)
        target = InstantTarget(accept=accept, engine_us=engine_us, overlap=overlap)
        draft = InstantDraft(engine_us=engine_us, overlap=overlap)
        s = Scheduler(target, draft, max_sequences=batch,
                      limits=Limits(max_queue=batch, stream_buffer=1 << 30, decode_ahead_ms=decode_ahead_ms,
                                    decode_most=16), spans=spans)  # events read, never `taken`
        if tracing == "sdk":
            s.spans = SdkCycleSpans(tracer)
        s.draft_restored()
        loop = asyncio.new_event_loop() if loop_thread else asyncio.get_running_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True) if loop_thread else None

        def on_loop(fn: Callable[[], Any]) -> Any:  # fn on the scheduler's loop, its result
            if thread is None:
                return fn()

            async def call() -> Any:
                return fn()
            return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=60)

        if thread is not None:
            thread.start()
        on_loop(s.start)
        tokens = cycles * (num_steps + 1 if accept else 1)
        req = GenerationRequest([1, 2, 3], tokens, Sampling(), set(), num_steps, adaptive=adaptive)
        requests = [tracer.start_span("generate") for _ in range(batch)]
        seqs = [s.submit(req, span) for span in requests]
        cpu0, reader0 = on_loop(time.thread_time), time.thread_time()
        proc0, wall0, cycles0 = time.process_time(), time.perf_counter(), s.cycles
        calls0 = target.calls + draft.calls
        for seq in seqs:
            while not isinstance(await seq.events.get(), Finished):
                pass
        wall, n = time.perf_counter() - wall0, s.cycles - cycles0
        cpu, reader = on_loop(time.thread_time) - cpu0, time.thread_time() - reader0
        computing = (target.calls + draft.calls - calls0) * engine_us * 1e-6
        proc = time.process_time() - proc0  # with the threads that export (sdk) or send (records)
        if thread is not None:
            asyncio.run_coroutine_threadsafe(s.stop(), loop).result(timeout=60)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=60)
            loop.close()
        else:
            await s.stop()
        for span in requests:
            span.end()
        if provider is not None:
            provider.shutdown()  # records: waits for the child to export them all
        written = sum(1 for f in Path(folder).glob("*.spans.jsonl") for _ in f.open())
    return {"bench": "scheduler_cpu", "batch": batch, "num_steps": "adaptive" if adaptive else num_steps,
            "accept": "all" if accept else "none", "tracing": tracing, "readers": "other thread" if loop_thread
            else "same loop", "cycles": n,
            "cpu_us_per_cycle": round(cpu / n * 1e6, 1), "wall_us_per_cycle": round(wall / n * 1e6, 1),
            "process_cpu_us_per_cycle": round(proc / n * 1e6, 1), "reader_cpu_us_per_cycle": round(reader / n * 1e6, 1),
            "cpu_us_per_sequence_cycle": round(cpu / n / batch * 1e6, 1), "decode_ahead_ms": decode_ahead_ms,
            "cpu_us_per_token_step": round(cpu / tokens * 1e6, 1), "spans_written": written,
            "spans_dropped": spans.dropped if spans is not None else 0, "engine_us": engine_us, "overlap": overlap,
            "beyond_engines_us_per_cycle": round((wall - computing) / n * 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=20000)
    p.add_argument("--batch", default="1,8", help="concurrent sequences, comma-separated")
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="each batch size this many times; the best is reported")
    p.add_argument("--tracing", default="off", help="comma list of off, sdk (the OpenTelemetry SDK's spans, "
                   "exported in this process), records (the gateway's span records, exported by a child process)")
    p.add_argument("--engine-us", type=float, default=0.0, help="each service call computes this long (busy-waited), "
                   "overlapped by the gateway's work between sending and reading (the report's "
                   "beyond_engines_us_per_cycle is the cycle's wall time less its calls' compute)")
    p.add_argument("--overlap", default="on", help="on,off: off starts each call's compute after that work instead")
    p.add_argument("--readers", default="same-loop", help="same-loop,other-thread: the readers of the tokens on the "
                   "scheduler's loop, or (as in the gateway) the scheduler on a thread of its own")
    p.add_argument("--adaptive", default="off", help="off,on: also (on) with the shape chosen per cycle "
                   "(gateway.adaptive)")
    p.add_argument("--decode-ahead-ms", default="0", help="comma list: the gateway's --decode-ahead-ms (0: a token "
                   "a call)")
    p.add_argument("--accept", default="all", choices=["all", "none"], help="the stub target accepts every draft, "
                   "or none (then adaptive cycles draft nothing but probes)")
    a = p.parse_args()
    install_uvloop()
    for b, tracing, adaptive, readers, overlap, ahead in (
            (int(x), t, m == "on", r, o == "on", float(d)) for x in a.batch.split(",") for t in a.tracing.split(",")
            for m in a.adaptive.split(",") for r in a.readers.split(",") for o in a.overlap.split(",")
            for d in a.decode_ahead_ms.split(",")):
        rows = [asyncio.run(measure(b, a.cycles, a.num_steps, tracing, adaptive, a.accept == "all", a.engine_us,
                                    readers == "other-thread", overlap, ahead)) for _ in range(a.rounds)]
        best = min(rows, key=lambda r: r["beyond_engines_us_per_cycle" if a.engine_us else "cpu_us_per_cycle"])
        best.update({"rounds": a.rounds, "all_cpu_us_per_cycle": [r["cpu_us_per_cycle"] for r in rows],
                     "commit": git_commit(), "machine": platform.machine(), "cpus": os.cpu_count(),
                     "python": platform.python_version()})
        print(json.dumps(best), flush=True)


if __name__ == "__main__":
    main()
