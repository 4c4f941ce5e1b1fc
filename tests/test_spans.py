"""Span records (specsplit.observability.spans): recorded as tuples, exported by a child process
with the configured exporter, flushed on shutdown, never raising into the serving thread."""

from __future__ import annotations

import enum
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from specsplit.observability.spans import (
    SAMPLED,
    SERVER,
    ShippingProcessor,
    SpanLog,
    parse_traceparent,
    record_entry,
    traceparent,
)
from specsplit.observability.trace_report import load_jsonl


@pytest.fixture
def jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jsonl")
    monkeypatch.setenv("SPECSPLIT_TRACE_DIR", str(tmp_path))
    return tmp_path


def running(pid: int) -> bool:
    """Neither gone nor a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class Color(enum.Enum):
    RED = 1


def test_records_reach_the_exporter_with_their_ids_attributes_and_events(jsonl: Path) -> None:
    spans = SpanLog("specsplit-test")
    provider = TracerProvider()
    provider.add_span_processor(ShippingProcessor(spans))
    request = provider.get_tracer("t").start_span("generate", kind=trace.SpanKind.SERVER, attributes={"a": 1})
    request.add_event("queued", {"depth": 2})
    request.set_status(trace.Status(trace.StatusCode.ERROR, "boom"))
    ctx = request.get_span_context()
    parent = traceparent(ctx.trace_id, ctx.span_id)
    for i in range(1000):
        record_entry(spans, "target.verify", parent, 10 + i, 20 + i, {"spec.seq_id": i, "why": Color.RED})
    request.end()
    provider.shutdown()  # flushes: the child exports everything, then exits
    assert spans.proc.returncode == 0 and spans.dropped == 0
    out = load_jsonl([jsonl])
    assert all(Path(f).name.startswith("specsplit-test-") for f in jsonl.glob("*.spans.jsonl"))
    entries = sorted((s for s in out if s["name"] == "target.verify"), key=lambda s: s["attributes"]["spec.seq_id"])
    assert [s["attributes"]["spec.seq_id"] for s in entries] == list(range(1000))
    assert all(s["trace_id"] == f"{ctx.trace_id:032x}" and s["parent_id"] == f"{ctx.span_id:016x}" for s in entries)
    assert entries[5]["start_ns"] == 15 and entries[5]["end_ns"] == 25
    assert entries[0]["attributes"]["why"] == "Color.RED"  # a value marshal does not know, as its str
    assert len({s["span_id"] for s in entries}) == 1000
    (req,) = [s for s in out if s["name"] == "generate"]
    assert req["span_id"] == f"{ctx.span_id:016x}" and req["parent_id"] is None and req["attributes"] == {"a": 1}
    assert [(e["name"], e["attributes"]) for e in req["events"]] == [("queued", {"depth": 2})]


@pytest.mark.parametrize("value", ["", "00-abc", "00-" + "0" * 32 + "-" + "1" * 16 + "-01",
                                   "00-" + "1" * 32 + "-" + "1" * 16 + "-00", "01-" + "1" * 32 + "-" + "1" * 16 + "-01",
                                   "00-" + "x" * 32 + "-" + "1" * 16 + "-01"])
def test_a_bad_or_unsampled_traceparent_records_nothing(value: str) -> None:
    assert parse_traceparent(value) is None


def test_a_traceparent_round_trips() -> None:
    assert parse_traceparent(traceparent(7 << 100, 9, SAMPLED)) == (7 << 100, 9)
    assert trace.SpanKind.SERVER.value == SERVER


def test_a_lost_exporter_drops_records_and_never_raises(jsonl: Path) -> None:
    spans = SpanLog("specsplit-test")
    spans.proc.kill()
    spans.proc.wait()
    record_entry(spans, "draft.release", traceparent(5, 6), 1, 2, {})
    spans.send()
    assert spans.dropped == 1
    spans.record(("x", 0, 5, 7, 0, 1, 1, 2, {}, None, None))
    spans.shutdown(timeout_s=5)
    assert spans.dropped == 2


def test_the_exporter_flushes_and_ends_when_its_service_dies(jsonl: Path) -> None:
    service = ("import os\nfrom specsplit.observability.spans import SpanLog, record_entry, traceparent\n"
               "spans = SpanLog('specsplit-test')\n"
               "record_entry(spans, 'target.prefill', traceparent(5, 6), 1, 2, {'n': 1})\n"
               "spans.send()\nprint(spans.proc.pid, flush=True)\nos._exit(0)\n")  # no shutdown
    out = subprocess.run([sys.executable, "-c", service], capture_output=True, text=True, timeout=60, check=True)
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child)
    assert [s["name"] for s in load_jsonl([jsonl])] == ["target.prefill"]


def test_shutdown_ends_even_when_the_exporter_stops_reading(jsonl: Path) -> None:
    spans = SpanLog("specsplit-test")
    assert spans.proc.stdin is not None
    spans.proc.stdin.close()  # the real child ends; in its place, one that never reads
    spans.proc.wait(timeout=30)
    spans.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE)
    for i in range(5000):  # ~1 MB marshalled: more than a pipe holds
        record_entry(spans, "target.verify", traceparent(5, 6), 1, 2, {"spec.seq_id": i, "pad": "x" * 100})
    time.sleep(0.2)  # the flusher is now blocked writing
    t0 = time.monotonic()
    spans.shutdown(timeout_s=1)
    assert time.monotonic() - t0 < 10 and spans.proc.returncode is not None
