"""Every cycle traced across the three processes; the trace report reads files and OTLP."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import pytest

from specsplit.cli.client import GatewayClient, Generation, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.observability.trace_report import load_jsonl
from specsplit.ports import free_port

PROMPTS = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3], [42] * 10]


def run_concurrently(addr: str) -> list[Generation]:
    client = GatewayClient(addr)
    out: dict[int, Generation] = {}

    def one(i: int) -> None:
        out[i] = client.generate(make_request(token_ids=PROMPTS[i], max_new_tokens=12 + 4 * i, num_steps=2 + i,
                                              ignore_eos=True))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    client.close()
    return [out[i] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def traced_run(tiny_target: Path, tiny_head: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, list[Generation]]:
    folder = tmp_path_factory.mktemp("traces")
    env = {"OTEL_TRACES_EXPORTER": "jsonl", "OTEL_METRICS_EXPORTER": "jsonl", "SPECSPLIT_TRACE_DIR": str(folder),
           "OTEL_TRACES_SAMPLER": "always_on", "OTEL_METRIC_EXPORT_INTERVAL": "500"}
    cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=256, env=env, log_dir=folder)
    with ServiceStack(cfg) as stack:
        gens = run_concurrently(stack.addr("gateway"))
    return folder, gens  # the stack has stopped: every exporter flushed


def test_each_trace_holds_exactly_its_cycles_with_parent_links(traced_run: tuple[Path, list[Generation]]) -> None:
    folder, gens = traced_run
    spans = load_jsonl([folder])
    assert {s["service"] for s in spans} == {"specsplit-gateway", "specsplit-draft", "specsplit-target"}
    by_trace: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        by_trace[s["trace_id"]].append(s)
    requests = [s for s in spans if s["name"] == "generate"]
    assert len(requests) == len(gens)
    for req in requests:
        trace = by_trace[req["trace_id"]]
        ids = {s["span_id"]: s for s in trace}
        a = req["attributes"]
        gen = next(g for g in gens if g.final.usage.completion_tokens == a["gen_ai.usage.output_tokens"]
                   and g.final.usage.prompt_tokens == a["gen_ai.usage.input_tokens"])
        assert a["gen_ai.request.max_tokens"] == len(gen.token_ids)  # ignore_eos: ran to the limit
        assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.request.model"]
        assert list(a["gen_ai.response.finish_reasons"]) == ["length"]
        assert {e["name"] for e in req["events"]} >= {"queued", "admitted", "first_token", "finished"}
        cycles = [s for s in trace if s["name"] == "cycle"]
        prefill = [s for s in trace if s["name"] == "prefill"]
        assert len(cycles) == gen.final.speculation.cycles and len(prefill) == 1
        assert all(s["parent_id"] == req["span_id"] for s in cycles + prefill)
        assert sorted(c["attributes"]["spec.cycle"] for c in cycles) == list(range(1, len(cycles) + 1))
        seq_ids = {c["attributes"]["spec.seq_id"] for c in cycles + prefill}
        assert len(seq_ids) == 1
        hist = [0] * (max(c["attributes"]["spec.accepted_length"] for c in cycles) + 1)
        for c in cycles:
            assert c["attributes"]["spec.num_steps"] == a["spec.num_steps"] == c["attributes"]["spec.draft_tokens"]
            assert c["attributes"]["spec.accepted_length"] == c["attributes"]["spec.num_accepted"] + 1
            hist[c["attributes"]["spec.accepted_length"]] += 1
            kids = [s for s in trace if s["parent_id"] == c["span_id"]]
            assert sorted(k["name"] for k in kids) == ["draft.extend_propose", "target.verify"]
            for k in kids:
                assert k["attributes"]["spec.seq_id"] in seq_ids and "handoff.generation" in k["attributes"]
                assert c["start_ns"] <= k["start_ns"] <= k["end_ns"] <= c["end_ns"]
        assert hist == list(gen.final.speculation.accepted_length_histogram)
        (pk,) = [s for s in trace if s["parent_id"] == prefill[0]["span_id"]]
        assert pk["name"] == "target.prefill" and pk["service"] == "specsplit-target"
        # nothing of another request leaks into this trace
        assert all(s["parent_id"] is None or s["parent_id"] in ids for s in trace)


def test_metrics_are_exported(traced_run: tuple[Path, list[Generation]]) -> None:
    folder, _ = traced_run
    text = "".join(p.read_text() for p in folder.glob("specsplit-gateway-*.metrics.jsonl"))
    for name in ("specsplit.cycle.duration", "specsplit.accepted_length", "gen_ai.server.time_to_first_token",
                 "gen_ai.server.time_per_output_token", "specsplit.request.tokens_per_second"):
        assert name in text


def test_trace_report_from_files(traced_run: tuple[Path, list[Generation]], tmp_path: Path) -> None:
    folder, gens = traced_run
    png = tmp_path / "timeline.png"
    proc = subprocess.run([sys.executable, "-m", "specsplit.cli", "trace", "report", str(folder), "--png", str(png),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["requests"] == len(gens)
    assert report["cycles"] == sum(g.final.speculation.cycles for g in gens)
    for part in ("total", "draft", "verify", "batched", "overhead"):
        assert set(report["cycle_ms"][part]) == {"p50", "p90", "p99"}
    assert report["cycle_ms"]["draft"]["p50"] > 0 and report["cycle_ms"]["verify"]["p50"] > 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_report_listens_for_otlp(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    port = free_port()
    listener = subprocess.Popen([sys.executable, "-m", "specsplit.cli", "trace", "report", "--listen",
                                 f"127.0.0.1:{port}", "--duration", "120", "--idle", "3", "--png", "", "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_TRACES_SAMPLER": "always_on", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=256, env=env, log_dir=tmp_path)
    with ServiceStack(cfg) as stack:
        client = GatewayClient(stack.addr("gateway"))
        gen = client.generate(make_request(token_ids=[5, 6, 7], max_new_tokens=10, num_steps=3, ignore_eos=True))
        client.close()
    out, err = listener.communicate(timeout=150)
    assert listener.returncode == 0, err
    report = json.loads(out[out.index("{"):])
    assert report["requests"] == 1 and report["cycles"] == gen.final.speculation.cycles


def test_sampling_ratio_zero_records_nothing(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    env = {"OTEL_TRACES_EXPORTER": "jsonl", "SPECSPLIT_TRACE_DIR": str(tmp_path),
           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}
    cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=256, env=env, log_dir=tmp_path)
    with ServiceStack(cfg) as stack:
        client = GatewayClient(stack.addr("gateway"))
        client.generate(make_request(token_ids=[5, 6, 7], max_new_tokens=6, num_steps=2))
        client.close()
    assert load_jsonl([tmp_path]) == []
