"""OpenTelemetry setup shared by the three services, configured by environment.

Standard variables: OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER (`otlp`, `console`,
`none`, and ours: `jsonl`), OTEL_EXPORTER_OTLP_ENDPOINT (and the other OTLP exporter
variables), OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (e.g.
`parentbased_traceidratio` and `0.1`), OTEL_METRIC_EXPORT_INTERVAL, OTEL_SDK_DISABLED,
OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES. Both exporters default to `none`.
`jsonl` writes one JSON object per span (or metrics batch) and line to a file in
SPECSPLIT_TRACE_DIR (default ./traces): `<service>-<pid>.spans.jsonl`; it needs no
backend, and `specsplit trace report` reads it.

Spans leave each process through a child process that runs the exporter
(specsplit.observability.spans).

Trace context travels inside every batched op as a W3C `traceparent` string, because
one long-lived stream message carries many requests' work (a per-RPC interceptor would
give one span per stream, not per request).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricsData, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from specsplit.observability.spans import ShippingProcessor, SpanLog

_PROPAGATOR = TraceContextTextMapPropagator()
EXPORTERS = ("none", "otlp", "console", "jsonl")


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One span as the compact JSON the jsonl exporter writes and the report reads."""
    ctx = span.get_span_context()
    return {
        "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "name": span.name, "service": span.resource.attributes.get("service.name", ""),
        "start_ns": span.start_time, "end_ns": span.end_time, "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in span.events],
    }


def _jsonl_file(service: str, kind: str, pid: int = 0) -> IO[str]:
    """The file of `service`'s process `pid` (default: this one)."""
    folder = Path(os.environ.get("SPECSPLIT_TRACE_DIR", "traces"))
    folder.mkdir(parents=True, exist_ok=True)
    return open(folder / f"{service}-{pid or os.getpid()}.{kind}.jsonl", "a", buffering=1)  # noqa: SIM115


def _exporter_name(var: str) -> str:
    name = os.environ.get(var, "none").strip().lower() or "none"
    if name not in EXPORTERS:
        raise ValueError(f"{var}={name!r}: choose one of {EXPORTERS}")
    return name


@dataclass
class Telemetry:
    tracer: trace.Tracer
    meter: metrics.Meter
    spans: SpanLog | None = None  # tracing on: the span records of the serving path go here
    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None

    @property
    def tracing(self) -> bool:
        return self.spans is not None

    def shutdown(self) -> None:
        """Flush and stop the exporters (the span exporter's process ends once it has flushed)."""
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


def span_exporter(service: str, pid: int) -> Any:
    """The exporter OTEL_TRACES_EXPORTER names, for the spans of process `pid` of `service`."""
    name = _exporter_name("OTEL_TRACES_EXPORTER")
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if name == "jsonl":
        return ConsoleSpanExporter(out=_jsonl_file(service, "spans", pid),
                                   formatter=lambda s: json.dumps(span_record(s)) + "\n")
    return ConsoleSpanExporter()


def setup_telemetry(service: str) -> Telemetry:
    """Configure tracing and metrics for one service process from the environment. Spans are
    exported by a child process (specsplit.observability.spans)."""
    disabled = os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true"
    traces = "none" if disabled else _exporter_name("OTEL_TRACES_EXPORTER")
    metric = "none" if disabled else _exporter_name("OTEL_METRICS_EXPORTER")
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service)})
    tracer_provider = meter_provider = spans = None
    if traces != "none":
        spans = SpanLog(service)
        tracer_provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER
        tracer_provider.add_span_processor(ShippingProcessor(spans))
    if metric != "none":
        if metric == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            metric_exporter: Any = OTLPMetricExporter()
        elif metric == "jsonl":
            metric_exporter = ConsoleMetricExporter(out=_jsonl_file(service, "metrics"),
                                                    formatter=lambda m: _metrics_line(m))
        else:
            metric_exporter = ConsoleMetricExporter()
        meter_provider = MeterProvider(resource=resource, metric_readers=[PeriodicExportingMetricReader(
            metric_exporter)])
    tracer = (tracer_provider or trace.NoOpTracerProvider()).get_tracer("specsplit")
    meter = (meter_provider or metrics.NoOpMeterProvider()).get_meter("specsplit")
    return Telemetry(tracer, meter, spans, tracer_provider, meter_provider)


def _metrics_line(data: MetricsData) -> str:
    return data.to_json(indent=None) + "\n"


def extract(traceparent: str) -> otel_context.Context | None:
    if not traceparent:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})
