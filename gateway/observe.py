"""What the gateway records: one span per request (gen_ai.*), one per cycle (spec.*),
and the loop's metrics."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import metrics, trace

from gateway.sequence import Sequence
from specsplit.observability.telemetry import inject


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


class CycleSpans:
    """One span per sequence and cycle, a child of its request span, whose trace context every
    op of the cycle carries. None with a no-op tracer: spans and trace context cost ~10% of the
    loop's CPU even then."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer, self.enabled = tracer, not isinstance(tracer, trace.NoOpTracer)

    def open(self, running: list[Sequence], newcomers: list[Sequence]) -> list[Sequence]:
        if not self.enabled:
            return []
        for s in running:
            s.cycle_span = self.tracer.start_span(
                "prefill" if s in newcomers else "cycle", context=trace.set_span_in_context(s.span),
                attributes={"spec.cycle": 0 if s in newcomers else s.stats.cycles + 1,
                            "spec.batch_size": len(running), "spec.num_steps": s.req.num_steps if s.spec else 0,
                            "spec.seq_id": s.seq_id, "spec.topk": s.req.topk})
            s.trace = inject(s.cycle_span)
        return list(running)

    def close(self, traced: list[Sequence]) -> None:
        for s in traced:
            s.cycle_span.end()
            s.cycle_span, s.trace = trace.INVALID_SPAN, ""
