"""What the gateway records: one span per request (gen_ai.*), one per cycle (spec.*),
and the loop's metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics, trace

from gateway.sequence import Sequence
from specsplit.observability.spans import INTERNAL, SAMPLED, SpanLog, new_span_id


@dataclass
class GatewayMetrics:
    cycle_duration: metrics.Histogram
    accepted_length: metrics.Histogram
    time_to_first_token: metrics.Histogram
    time_per_output_token: metrics.Histogram
    tokens_per_second: metrics.Histogram
    output_tokens: metrics.Counter

    @classmethod
    def create(cls, meter: metrics.Meter) -> GatewayMetrics:
        return cls(
            cycle_duration=meter.create_histogram("specsplit.cycle.duration", unit="ms",
                                                  description="one draft + verify cycle of the whole batch"),
            accepted_length=meter.create_histogram("specsplit.accepted_length", unit="{token}",
                                                   description="tokens emitted per cycle per sequence (tau)"),
            time_to_first_token=meter.create_histogram("gen_ai.server.time_to_first_token", unit="s"),
            time_per_output_token=meter.create_histogram("gen_ai.server.time_per_output_token", unit="s"),
            tokens_per_second=meter.create_histogram("specsplit.request.tokens_per_second", unit="{token}/s"),
            output_tokens=meter.create_counter("specsplit.output_tokens", unit="{token}"),
        )


NOOP_TRACER = trace.NoOpTracerProvider().get_tracer("specsplit")
NOOP_METRICS = GatewayMetrics.create(metrics.NoOpMeterProvider().get_meter("specsplit"))


class CycleSpan:
    """One sequence's span of one cycle, a record until it ends (specsplit.observability.spans):
    what the loop sets on it goes into a dict."""

    __slots__ = ("attributes", "log", "name", "parent_id", "span_id", "start_ns", "trace_id")

    def __init__(self, log: SpanLog, name: str, trace_id: int, parent_id: int, attributes: dict[str, Any]) -> None:
        self.log, self.name, self.trace_id, self.parent_id = log, name, trace_id, parent_id
        self.span_id, self.start_ns, self.attributes = new_span_id(), time.time_ns(), attributes

    def is_recording(self) -> bool:
        return True

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self.attributes.update(attributes)

    def end(self) -> None:
        self.log.record((self.name, INTERNAL, self.trace_id, self.span_id, self.parent_id, SAMPLED, self.start_ns,
                         time.time_ns(), self.attributes, None, None))


class CycleSpans:
    """One span per sequence and cycle, a child of its request span, whose trace context every
    op of the cycle carries; none for a request whose span is not sampled, or without tracing."""

    def __init__(self, log: SpanLog | None) -> None:
        self.log = log

    def open(self, running: list[Sequence], newcomers: list[Sequence]) -> list[Sequence]:
        if self.log is None:
            return []
        traced = []
        for s in running:
            if s.trace_ids is None:  # not sampled
                continue
            trace_id, parent_id, head = s.trace_ids
            prefill = s in newcomers or not s.prefilled  # (a prompt in parts: each of its cycles)
            span = s.cycle_span = CycleSpan(
                self.log, "prefill" if prefill else "cycle", trace_id, parent_id,
                {"spec.cycle": 0 if prefill else s.stats.cycles + 1, "spec.batch_size": len(running),
                 "spec.num_steps": s.req.num_steps if s.spec else 0, "spec.seq_id": s.seq_id, "spec.topk": s.req.topk})
            s.trace = f"{head}{span.span_id:016x}-01"  # the W3C traceparent, sampled
            traced.append(s)
        return traced

    def close(self, traced: list[Sequence]) -> None:
        for s in traced:
            s.cycle_span.end()
            s.cycle_span, s.trace = trace.INVALID_SPAN, ""
