"""What the gateway records: one span per request (gen_ai.*), one per cycle (spec.*),
and the loop's metrics."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import metrics, trace


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
