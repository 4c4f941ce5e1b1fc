"""`specsplit trace report`: where did each cycle's time go?

Reads spans from jsonl files written by the services (OTEL_TRACES_EXPORTER=jsonl), or
receives them over OTLP/gRPC on an address it listens on, then prints percentiles of
cycle time split into draft, verify and transport + scheduling, the accepted-length
histogram and tokens/s per request, and writes a PNG timeline.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Span = dict[str, Any]


def load_jsonl(paths: Iterable[str | Path]) -> list[Span]:
    spans: list[Span] = []
    for p in paths:
        p = Path(p)
        files = sorted(p.glob("*.spans.jsonl")) if p.is_dir() else [p]
        for f in files:
            with open(f) as fh:
                spans.extend(json.loads(line) for line in fh if line.strip())
    return spans


def _any_value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def otlp_to_records(request: Any) -> list[Span]:
    out = []
    for rs in request.resource_spans:
        service = next((_any_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            for sp in ss.spans:
                out.append({
                    "trace_id": sp.trace_id.hex(), "span_id": sp.span_id.hex(),
                    "parent_id": sp.parent_span_id.hex() or None, "name": sp.name, "service": service,
                    "start_ns": sp.start_time_unix_nano, "end_ns": sp.end_time_unix_nano,
                    "attributes": {a.key: _any_value(a.value) for a in sp.attributes},
                    "events": [{"name": e.name, "time_ns": e.time_unix_nano,
                                "attributes": {a.key: _any_value(a.value) for a in e.attributes}} for e in sp.events],
                })
    return out


def receive_otlp(addr: str, duration_s: float, idle_s: float = 0.0) -> list[Span]:
    """Listen for OTLP/gRPC trace exports on `addr` for `duration_s` seconds (or until
    nothing arrived for `idle_s` seconds after the first batch)."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[Span] = []
    last = [0.0]

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
            received.extend(otlp_to_records(request))
            last[0] = time.monotonic()
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    server.add_insecure_port(addr)
    server.start()
    print(f"listening for OTLP/gRPC spans on {addr}", flush=True)
    deadline = time.monotonic() + duration_s
    try:
        while time.monotonic() < deadline:
            if idle_s and last[0] and time.monotonic() - last[0] > idle_s:
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    server.stop(grace=1.0)
    return received


@dataclass
class Cycle:
    trace_id: str
    start_ns: int
    end_ns: int
    draft: list[tuple[int, int]] = field(default_factory=list)  # server-side intervals
    verify: list[tuple[int, int]] = field(default_factory=list)
    accepted: int = 0
    batch_ms: float = 0.0  # engine time of both batched calls, every sequence's entries included

    @property
    def total_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def draft_ms(self) -> float:
        return sum(e - s for s, e in self.draft) / 1e6

    @property
    def verify_ms(self) -> float:
        return sum(e - s for s, e in self.verify) / 1e6

    @property
    def batched_ms(self) -> float:
        """Engine time spent on other sequences of the same batched calls."""
        return max(self.batch_ms - self.draft_ms - self.verify_ms, 0.0)

    @property
    def overhead_ms(self) -> float:
        """Transport and scheduling: the cycle minus all engine work in its calls."""
        return self.total_ms - self.draft_ms - self.verify_ms - self.batched_ms


@dataclass
class Request:
    trace_id: str
    start_ns: int
    end_ns: int
    output_tokens: int
    cycles: list[Cycle]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / max((self.end_ns - self.start_ns) / 1e9, 1e-9)


def analyze(spans: list[Span]) -> list[Request]:
    children: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.get("parent_id"):
            children[s["parent_id"]].append(s)
    requests = []
    for r in (s for s in spans if s["name"] == "generate"):
        cycles = []
        for c in sorted((s for s in children[r["span_id"]] if s["name"] == "cycle"), key=lambda s: s["start_ns"]):
            attrs = c["attributes"]
            cyc = Cycle(r["trace_id"], c["start_ns"], c["end_ns"], accepted=int(attrs.get("spec.accepted_length", 0)),
                        batch_ms=float(attrs.get("spec.draft_batch_ms", 0.0)) + float(
                            attrs.get("spec.verify_batch_ms", 0.0)))
            for k in children[c["span_id"]]:
                interval = (k["start_ns"], k["end_ns"])
                (cyc.draft if k["name"].startswith("draft.") else cyc.verify).append(interval)
            cycles.append(cyc)
        out = int(r["attributes"].get("gen_ai.usage.output_tokens", 0))
        requests.append(Request(r["trace_id"], r["start_ns"], r["end_ns"], out, cycles))
    return sorted(requests, key=lambda q: q.start_ns)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0]}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


def summary(requests: list[Request]) -> dict[str, Any]:
    cycles = [c for r in requests for c in r.cycles]
    hist = Counter(c.accepted for c in cycles)
    return {
        "requests": len(requests), "cycles": len(cycles),
        "cycle_ms": {k: {p: round(v, 3) for p, v in percentiles([getattr(c, f"{k}_ms") for c in cycles]).items()}
                     for k in ("total", "draft", "verify", "batched", "overhead")},
        "accepted_length_histogram": {str(k): hist[k] for k in sorted(hist)},
        "mean_accepted_length": round(sum(c.accepted for c in cycles) / len(cycles), 4) if cycles else 0.0,
        "per_request": [{"trace_id": r.trace_id, "output_tokens": r.output_tokens, "cycles": len(r.cycles),
                         "tokens_per_s": round(r.tokens_per_s, 3)} for r in requests],
    }


def format_text(s: dict[str, Any]) -> str:
    lines = [f"{s['requests']} requests, {s['cycles']} cycles, mean accepted length {s['mean_accepted_length']}",
             "cycle time (ms)         p50        p90        p99"]
    names = {"total": "cycle", "draft": "draft", "verify": "verify", "batched": "other sequences",
             "overhead": "transport+scheduling"}
    for key, label in names.items():
        p = s["cycle_ms"][key]
        lines.append(f"  {label:<20} {p['p50']:>9.3f}  {p['p90']:>9.3f}  {p['p99']:>9.3f}")
    lines.append("accepted length histogram: " + ", ".join(f"{k}: {v}" for k, v in
                                                          s["accepted_length_histogram"].items()))
    for r in s["per_request"]:
        lines.append(f"  request {r['trace_id'][:12]}  {r['output_tokens']:>5} tokens  {r['cycles']:>4} cycles  "
                     f"{r['tokens_per_s']:>9.2f} tok/s")
    return "\n".join(lines)


def plot(requests: list[Request], png: str | Path, max_cycles: int = 200) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"draft": "#4C72B0", "verify": "#DD8452", "batched": "#8172B3", "overhead": "#BBBBBB"}
    fig, (ax_t, ax_b, ax_a) = plt.subplots(3, 1, figsize=(12, 10), gridspec_kw={"height_ratios": [2, 2, 1.3]})
    t0 = min((r.start_ns for r in requests), default=0)
    for row, r in enumerate(requests):
        for c in r.cycles:  # the whole cycle in grey, a white edge between cycles
            ax_t.broken_barh([((c.start_ns - t0) / 1e6, c.total_ms)], (row - 0.4, 0.8), facecolor=colors["overhead"],
                             edgecolor="white", linewidth=0.6)
            for kind in ("draft", "verify"):
                spans = [((s - t0) / 1e6, (e - s) / 1e6) for s, e in getattr(c, kind)]
                ax_t.broken_barh(spans, (row - 0.3, 0.6), color=colors[kind])
    ax_t.set_yticks(range(len(requests)), [r.trace_id[:8] for r in requests])
    ax_t.invert_yaxis()
    ax_t.set_xlabel("time since the first request (ms)")
    ax_t.set_title("timeline per request: cycles (grey: waiting on transport, scheduling and batch-mates) "
                   "with own draft and verify work")
    cycles = [c for r in requests for c in r.cycles][:max_cycles]
    x = range(len(cycles))
    bottom = [0.0] * len(cycles)
    labels = {"draft": "draft", "verify": "verify", "batched": "other sequences in the batch",
              "overhead": "transport + scheduling"}
    for kind, label in labels.items():
        values = [max(getattr(c, f"{kind}_ms"), 0.0) for c in cycles]
        ax_b.bar(x, values, bottom=bottom, color=colors[kind], label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax_b.set_ylabel("ms")
    ax_b.set_xlabel("cycle (requests in order)")
    ax_b.set_title("cycle time split")
    ax_b.legend(loc="upper right")
    ax_a.bar(x, [c.accepted for c in cycles], color="#55A868")
    ax_a.set_ylabel("tokens")
    ax_a.set_xlabel("cycle (requests in order)")
    ax_a.set_title("accepted length per cycle (bonus token included)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
