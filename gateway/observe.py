"""What the gateway records: one span per request (gen_ai.*), one per cycle (spec.*),
and the loop's metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics, trace

from gateway.costs import Shape
from gateway.outbox import Outbox
from gateway.sequence import Finished, LoopTotals, Sequence
from specsplit.observability.spans import INTERNAL, SAMPLED, SpanLog, new_span_id
from specsplit.ops import StepTiming, TargetResult


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

    def __init__(self, log: SpanLog, name: str, trace_id: int, parent_id: int, start_ns: int,
                 attributes: dict[str, Any]) -> None:
        self.log, self.name, self.trace_id, self.parent_id = log, name, trace_id, parent_id
        self.span_id, self.start_ns, self.attributes = new_span_id(), start_ns, attributes

    def is_recording(self) -> bool:
        return True

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self.attributes.update(attributes)

    def end(self, end_time: int | None = None) -> None:
        self.log.record((self.name, INTERNAL, self.trace_id, self.span_id, self.parent_id, SAMPLED, self.start_ns,
                         end_time or time.time_ns(), self.attributes, None, None))


class CycleSpans:
    """One span per sequence and cycle, a child of its request span, whose trace context every
    op of the cycle carries; none for a request whose span is not sampled, or without tracing.
    The spans of a cycle share its start and end times; they are recorded once their cycle's
    bookkeeping is done (gateway.outbox)."""

    def __init__(self, log: SpanLog | None) -> None:
        self.log = log

    def open(self, running: list[Sequence], newcomers: list[Sequence]) -> list[Sequence]:
        if self.log is None:
            return []
        traced = []
        start, batch = time.time_ns(), len(running)
        for s in running:
            if s.trace_ids is None:  # not sampled
                continue
            trace_id, parent_id, head = s.trace_ids
            prefill = not s.prefilled or s in newcomers  # (a prompt in parts: each of its cycles)
            span = s.cycle_span = CycleSpan(
                self.log, "prefill" if prefill else "cycle", trace_id, parent_id, start,
                {"spec.cycle": 0 if prefill else s.stats.cycles + 1, "spec.batch_size": batch,
                 "spec.num_steps": s.req.num_steps if s.spec else 0, "spec.seq_id": s.seq_id, "spec.topk": s.req.topk})
            s.trace = f"{head}{span.span_id:016x}-01"  # the W3C traceparent, sampled
            traced.append(s)
        return traced

    def close(self, traced: list[Sequence], outbox: Outbox) -> None:
        """The cycle's spans end now; they are recorded with the cycle's bookkeeping."""
        if not traced:
            return
        spans = [s.cycle_span for s in traced]
        for s in traced:
            s.cycle_span, s.trace = trace.INVALID_SPAN, ""
        outbox.later(_end, spans, time.time_ns())


def _end(spans: list[trace.Span | CycleSpan], end_time: int) -> None:
    for span in spans:
        span.end(end_time)


def record_draft(seqs: list[tuple[Sequence, trace.Span | CycleSpan]], ms: float, timing: StepTiming) -> None:
    """A draft call's statistics and span attributes for the sequences it drafted (put off: gateway.outbox)."""
    attributes = {"spec.draft_call_ms": ms, "spec.draft_batch_ms": timing.compute_ms,
                  "spec.draft_service_ms": timing.total_ms}
    for s, span in seqs:
        if span.is_recording():
            span.set_attributes(attributes)
        s.stats.draft_ms += ms
        s.stats.draft_compute_ms += timing.compute_ms
        s.stats.draft_service_ms += timing.total_ms


def record_verify(s: Sequence, span: trace.Span | CycleSpan, totals: LoopTotals, instruments: GatewayMetrics,
                  r: TargetResult, ms: float, timing: StepTiming, drafted: int, decoded: int, shape: Shape) -> None:
    """A verify's statistics, metrics and span attributes (put off: gateway.outbox)."""
    s.stats.record_verify(len(r.tokens), ms, timing, drafted, r.num_accepted, shape, decoded)
    totals.record_verify(len(r.tokens), drafted, r.num_accepted, decoded)
    if decoded == 1:
        instruments.accepted_length.record(len(r.tokens))
    if span.is_recording():
        span.set_attributes({"spec.draft_tokens": drafted, "spec.accepted_length": len(r.tokens),
                             "spec.num_accepted": r.num_accepted, "spec.bonus_token": r.tokens[-1],
                             "spec.decode_tokens": decoded, "spec.verify_call_ms": ms,
                             "spec.verify_batch_ms": timing.compute_ms, "spec.verify_service_ms": timing.total_ms})


def record_finish(s: Sequence, end: Finished, instruments: GatewayMetrics, now: float) -> None:
    """A finished sequence's metrics and its request span's event (put off: gateway.outbox)."""
    n = len(s.generated)
    instruments.output_tokens.add(n)
    if n > 1 and s.stats.first_token_at:
        instruments.time_per_output_token.record((now - s.stats.first_token_at) / (n - 1))
    if n:
        instruments.tokens_per_second.record(n / max(now - s.submitted_at, 1e-9))
    s.span.add_event("finished", {"gen_ai.response.finish_reason": end.reason, "spec.cycles": s.stats.cycles})
