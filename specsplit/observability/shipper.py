"""The child process that exports a service's spans (specsplit.observability.spans): frames of
marshalled span records on stdin become the SDK's spans, handed to a batch processor and the
exporter the environment names; at the end of stdin it flushes and exits.

  python -m specsplit.observability.shipper <service> <parent pid>
"""

from __future__ import annotations

import marshal
import os
import signal
import sys
from typing import Any, BinaryIO

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from specsplit.observability.spans import FRAME
from specsplit.observability.telemetry import span_exporter

QUEUE = 1 << 17  # spans the batch processor holds before it drops (a slow backend)


def readable(rec: list[Any] | tuple[Any, ...], resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    name, kind, trace_id, span_id, parent_id, flags, start, end, attributes, events, status = rec
    ctx = SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(flags))
    parent = SpanContext(trace_id, parent_id, is_remote=False, trace_flags=TraceFlags(flags)) if parent_id else None
    return ReadableSpan(
        name, ctx, parent, resource, BoundedAttributes(attributes=attributes, immutable=True),  # checked here
        [Event(n, BoundedAttributes(attributes=a, immutable=True), t) for n, t, a in events or ()],
        kind=SpanKind(kind), status=Status(StatusCode(status[0]), status[1] or None) if status else Status(),
        start_time=start, end_time=end, instrumentation_scope=scope)


def _read(stream: BinaryIO, n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def main() -> None:
    service, parent_pid = sys.argv[1], int(sys.argv[2])
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service)})
    scope = InstrumentationScope("specsplit")
    processor = BatchSpanProcessor(span_exporter(service, parent_pid), max_queue_size=QUEUE)
    # a signal to the service's process group is the service's to act on: this process ends when the
    # service closes its stdin (its shutdown, or its exit of any kind)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    try:
        while (head := _read(stdin, FRAME.size)) is not None:
            data = _read(stdin, FRAME.unpack(head)[0])
            if data is None:
                break
            for rec in marshal.loads(data):
                processor.on_end(readable(rec, resource, scope))
    finally:
        processor.shutdown()


if __name__ == "__main__":
    main()
