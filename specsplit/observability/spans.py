"""Spans recorded on the serving path at the cost of a tuple, exported by a child process.

An OpenTelemetry SDK span costs tens of µs to build (attribute checks, context, processors)
and an OTLP exporter about as much again per span to encode, all under the GIL of the
process that serves: with a span per sequence and cycle in the gateway and one per op and step
in each service, tracing every cycle would put milliseconds a cycle on the serving threads.
Here a span is a plain tuple (`SpanRecord`) appended to a list; a flusher thread hands the
list every few milliseconds to a child process (`python -m specsplit.observability.shipper`)
as one marshalled frame on its stdin, and the child builds the SDK's spans and runs the
configured exporter (OTLP, console, jsonl). The SDK's own spans (the gateway's request spans)
reach the same child through `ShippingProcessor`.

Records past `max_pending` unsent ones are dropped and counted (as the SDK's batch processor
drops past its queue). The child ends when its stdin closes: `shutdown` sends what is left,
closes it and waits for the child's exporter to flush."""

from __future__ import annotations

import contextlib
import logging
import marshal
import os
import random
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import Span

log = logging.getLogger("specsplit.spans")

# name, kind (SpanKind's value), trace_id, span_id, parent span_id (0: a root), trace flags,
# start_ns, end_ns, attributes, events [(name, time_ns, attributes)] or None,
# status (code, description) or None
SpanRecord = tuple[str, int, int, int, int, int, int, int, dict[str, Any], list[Any] | None,
                   tuple[int, str] | None]
FRAME = struct.Struct("<I")
INTERNAL, SERVER = 0, 1  # SpanKind values
SAMPLED = 1


def new_span_id() -> int:
    return random.getrandbits(64) or 1


def traceparent(trace_id: int, span_id: int, flags: int = SAMPLED) -> str:
    """The W3C traceparent of a span."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def parse_traceparent(value: str) -> tuple[int, int] | None:
    """(trace_id, parent span_id) of a sampled W3C traceparent; None when it is empty, malformed
    or not sampled (its spans are not recorded)."""
    if len(value) != 55 or not value.startswith("00-") or value[35] != "-" or value[52] != "-":
        return None
    try:
        trace_id, span_id, flags = int(value[3:35], 16), int(value[36:52], 16), int(value[53:55], 16)
    except ValueError:
        return None
    if not trace_id or not span_id or not flags & SAMPLED:
        return None
    return trace_id, span_id


class SpanLog:
    """The process's span records and the child process that exports them."""

    def __init__(self, service: str, interval_s: float = 0.005, max_pending: int = 1 << 16) -> None:
        self.service, self.interval_s, self.max_pending = service, interval_s, max_pending
        self.pending: list[SpanRecord] = []
        self.dropped = 0
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the child imports this same specsplit
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "specsplit.observability.shipper", service,
                                      str(os.getpid())], stdin=subprocess.PIPE, env=env)
        self.closing = threading.Event()
        self.lock = threading.Lock()  # one sender at a time (the flusher, or shutdown)
        self.flusher = threading.Thread(target=self._run, name="span-flusher", daemon=True)
        self.flusher.start()

    def record(self, rec: SpanRecord) -> None:
        """One finished span (any thread): appended, sent with the next batch."""
        if len(self.pending) >= self.max_pending:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, ... : a line now and then
                log.warning("%d span records dropped: the exporter does not keep up", self.dropped)
            return
        self.pending.append(rec)

    def _run(self) -> None:
        while not self.closing.wait(self.interval_s):
            self.send()

    def send(self) -> None:
        """Hand every pending record to the child (the flusher's thread, or shutdown's)."""
        with self.lock:
            if not self.pending:
                return
            if self.proc.stdin is None:  # the child is gone
                self.dropped += len(self.pending)
                self.pending = []
                return
            batch, self.pending = self.pending, []  # records appended meanwhile go to the next batch
            try:
                data = marshal.dumps(batch)
            except ValueError:  # a value of a type marshal does not know: written as its str
                data = marshal.dumps([_plain_record(r) for r in batch])
            try:
                self.proc.stdin.write(FRAME.pack(len(data)) + data)
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):  # the child is gone: nothing exports any more
                self.dropped += len(batch)
                with contextlib.suppress(OSError, ValueError):
                    self.proc.stdin.close()
                self.proc.stdin = None
                log.warning("the span exporter process exited (code %s): spans are dropped", self.proc.poll())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Send what is left, close the child's input and wait up to `timeout_s` for its exporter
        to flush; a child that does not read or finish in time is killed (its spans are lost)."""
        if self.closing.is_set():
            return
        self.closing.set()
        self.flusher.join(timeout=timeout_s)
        if self.flusher.is_alive():  # blocked writing to a child that does not read
            log.warning("the span exporter process stopped reading: killed")
            self.proc.kill()
            self.flusher.join()  # its write fails now
        self.send()
        with self.lock:
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError, ValueError):
                    self.proc.stdin.close()
                self.proc.stdin = None
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the span exporter process did not finish in %.0f s: killed", timeout_s)
            self.proc.kill()
            self.proc.wait()


class ShippingProcessor(SpanProcessor):
    """The SDK's spans (e.g. the gateway's request spans) into a SpanLog."""

    def __init__(self, spans: SpanLog) -> None:
        self.spans = spans

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        ctx = span.get_span_context()
        if ctx is None or not ctx.trace_flags.sampled:
            return
        events = [(e.name, e.timestamp, dict(e.attributes or {})) for e in span.events]
        status = (span.status.status_code.value, span.status.description or "") if span.status else None
        self.spans.record((span.name, span.kind.value, ctx.trace_id, ctx.span_id,
                           span.parent.span_id if span.parent is not None else 0, int(ctx.trace_flags),
                           span.start_time or 0, span.end_time or 0, dict(span.attributes or {}), events, status))

    def shutdown(self) -> None:
        self.spans.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.spans.send()
        return True


def record_entry(spans: SpanLog, name: str, parent: str, start_ns: int, end_ns: int,
                 attributes: dict[str, Any]) -> None:
    """A service's span for one batched entry, timed by its engine, child of the gateway's
    cycle span named by the W3C traceparent `parent` (nothing when it is empty or unsampled)."""
    ids = parse_traceparent(parent)
    if ids is None or not start_ns:
        return
    spans.record((name, SERVER, ids[0], new_span_id(), ids[1], SAMPLED, start_ns, end_ns, attributes, None, None))


def _plain(value: Any) -> Any:
    if isinstance(value, str | bool | int | float | bytes) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def _plain_record(rec: SpanRecord) -> SpanRecord:
    events = [(n, t, {k: _plain(v) for k, v in a.items()}) for n, t, a in rec[9]] if rec[9] else rec[9]
    return (*rec[:8], {k: _plain(v) for k, v in rec[8].items()}, events, rec[10])  # type: ignore[return-value]
