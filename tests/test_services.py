"""Integration: the three real services as processes on free loopback ports, over gRPC."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.tokenizer import TextCodec
from specsplit.v1 import draft_pb2, target_pb2

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> ServiceStack:
    cfg = StackConfig.of(model="smollm2", head="random", max_context=512, max_sequences=4, num_steps=3,
                         log_dir=tmp_path_factory.mktemp("logs"))
    with ServiceStack(cfg) as s:
        yield s


def service_stats(stack: ServiceStack) -> tuple[target_pb2.TargetStats, draft_pb2.DraftStats]:
    target, draft = stack.stats()
    assert draft is not None, "these stacks run a draft service"
    return target, draft


def wait_idle(stack: ServiceStack, timeout: float = 10.0) -> tuple[target_pb2.TargetStats, draft_pb2.DraftStats]:
    deadline = time.monotonic() + timeout
    while True:
        t, d = service_stats(stack)
        idle = t.active_sequences == 0 and t.ring_rows_in_use == 0 and d.active_sequences == 0
        if idle or time.monotonic() > deadline:
            return t, d
        time.sleep(0.1)


def test_streams_tokens_then_a_summary(client: GatewayClient) -> None:
    chunks = list(client.stream(make_request(PROMPT, max_new_tokens=16)))
    assert len(chunks) >= 2 and chunks[-1].HasField("final")
    assert all(not c.HasField("final") for c in chunks[:-1])
    final = chunks[-1].final
    ids = [t for c in chunks for t in c.token_ids]
    assert final.usage.completion_tokens == len(ids) and final.finish_reason in ("stop", "length")
    assert final.speculation.enabled and final.speculation.adaptive  # num_steps unset: chosen per cycle
    assert final.speculation.cycles == sum(final.speculation.accepted_length_histogram)
    assert "Paris" in "".join(c.text for c in chunks)


@pytest.mark.parametrize("steps", [1, 4, 6])
def test_speculative_equals_target_only_over_grpc(client: GatewayClient, steps: int) -> None:
    base = client.generate(make_request(PROMPT, max_new_tokens=24, speculation=False))
    spec = client.generate(make_request(PROMPT, max_new_tokens=24, num_steps=steps))
    assert spec.token_ids == base.token_ids and spec.text == base.text
    assert not base.final.speculation.enabled and spec.final.speculation.num_steps == steps


def test_the_summary_splits_each_call_into_engine_service_and_transport(client: GatewayClient) -> None:
    s = client.generate(make_request(PROMPT, max_new_tokens=24, num_steps=3)).final.speculation
    assert 0 < s.draft_compute_ms <= s.draft_service_ms <= s.draft_ms
    assert 0 < s.verify_compute_ms <= s.verify_service_ms <= s.verify_ms


@pytest.mark.parametrize("topk,num_draft_tokens", [(2, 6), (4, 16)])
def test_trees_equal_target_only_over_grpc(client: GatewayClient, topk: int, num_draft_tokens: int) -> None:
    base = client.generate(make_request(PROMPT, max_new_tokens=24, speculation=False))
    tree = client.generate(make_request(PROMPT, max_new_tokens=24, num_steps=3, topk=topk,
                                        num_draft_tokens=num_draft_tokens))
    assert tree.token_ids == base.token_ids and tree.text == base.text
    s = tree.final.speculation
    assert s.enabled and (s.num_steps, s.topk, s.num_draft_tokens) == (3, topk, num_draft_tokens)
    chain = client.generate(make_request(PROMPT, max_new_tokens=8, num_steps=3)).final.speculation
    assert (chain.topk, chain.num_draft_tokens) == (1, 4)


def test_token_id_input_and_stop_tokens(client: GatewayClient, smollm2_dir: Path) -> None:
    text = "Count: 1, 2, 3,"
    ref = client.generate(make_request(text, raw=True, max_new_tokens=12, ignore_eos=True))
    codec = TextCodec.from_checkpoint(smollm2_dir)
    by_ids = client.generate(make_request(token_ids=codec.encode(text), max_new_tokens=12, ignore_eos=True))
    assert by_ids.token_ids == ref.token_ids and by_ids.final.finish_reason == "length"
    stop = ref.token_ids[5]
    got = client.generate(make_request(text, raw=True, max_new_tokens=12, stop_token_ids=[stop], ignore_eos=True))
    assert got.token_ids == ref.token_ids[: ref.token_ids.index(stop)]
    assert got.final.finish_reason == "stop" and got.final.matched_stop_token == stop


BAD_REQUESTS = {
    "empty prompt": dict(prompt="   "),
    "empty token ids": dict(token_ids=[]),
    "max_new_tokens zero": dict(prompt=PROMPT, max_new_tokens=0),
    "max_new_tokens negative": dict(prompt=PROMPT, max_new_tokens=-5),
    "max_new_tokens over cap": dict(prompt=PROMPT, max_new_tokens=10**6),
    "prompt longer than context": dict(token_ids=[42] * 600),
    "text prompt longer than context": dict(prompt="word " * 2000),
    "prompt + max_new_tokens over context": dict(token_ids=[42] * 400, max_new_tokens=200),
    "negative temperature": dict(prompt=PROMPT, temperature=-0.5),
    "nan temperature": dict(prompt=PROMPT, temperature=math.nan),
    "inf top_p": dict(prompt=PROMPT, top_p=math.inf),
    "zero top_p": dict(prompt=PROMPT, top_p=0.0),
    "negative top_k": dict(prompt=PROMPT, top_k=-1),
    "unknown token id": dict(token_ids=[1, 2, 49152]),
    "negative token id": dict(token_ids=[1, -3]),
    "unknown stop token": dict(prompt=PROMPT, stop_token_ids=[10**7]),
    "too many steps": dict(prompt=PROMPT, num_steps=99),
    "tree with sampling": dict(prompt=PROMPT, temperature=0.7, topk=4),
    "topk too wide": dict(prompt=PROMPT, topk=99),
    "tree too large": dict(prompt=PROMPT, topk=4, num_draft_tokens=999),
    "chain with a tree size": dict(prompt=PROMPT, num_steps=3, topk=1, num_draft_tokens=9),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_requests_are_invalid_argument(client: GatewayClient, name: str) -> None:
    kw = BAD_REQUESTS[name]
    req = make_request(kw.pop("prompt", None), **kw) if "token_ids" not in kw else make_request(**kw)
    with pytest.raises(grpc.RpcError) as err:
        client.generate(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details() and "Traceback" not in err.value.details()


def test_still_serving_after_bad_requests_and_nothing_leaks(stack: ServiceStack, client: GatewayClient) -> None:
    for name in ("empty prompt", "unknown token id", "prompt longer than context"):
        kw = dict(BAD_REQUESTS[name])
        req = make_request(kw.pop("prompt", None), **kw) if "token_ids" not in kw else make_request(**kw)
        with pytest.raises(grpc.RpcError):
            client.generate(req, timeout=60)
    out = client.generate(make_request(PROMPT, max_new_tokens=8))
    assert out.final.usage.completion_tokens > 0
    t, d = wait_idle(stack)
    assert (t.active_sequences, t.ring_rows_in_use, t.ring_live_allocations, d.active_sequences) == (0, 0, 0, 0)
    assert t.free_kv_slots == 4 and d.free_kv_slots == 4
    assert t.graphs_captured_while_serving == d.graphs_captured_while_serving == 0  # (no graphs on the CPU)
    assert t.steps_past_graph_budget == d.steps_past_graph_budget == 0
    assert t.graph_capture_ms_while_serving == d.graph_capture_ms_while_serving == 0


def test_client_cancel_releases_the_sequence(stack: ServiceStack, client: GatewayClient) -> None:
    call = client.stub.Generate(make_request("Tell me a long story about a dragon.", max_new_tokens=400))
    first = next(call)
    assert first.token_ids
    t, _ = service_stats(stack)
    assert t.active_sequences == 1
    call.cancel()
    t, d = wait_idle(stack)
    assert t.active_sequences == 0 and d.active_sequences == 0 and t.ring_rows_in_use == 0


def test_concurrent_streams_equal_solo_runs(client: GatewayClient) -> None:
    prompts = [PROMPT, "Name three colours.", "What is 2 + 2?", "Say hello in French."]
    solo = [client.generate(make_request(p, max_new_tokens=12, num_steps=2 + i)).token_ids
            for i, p in enumerate(prompts)]
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = client.generate(make_request(prompts[i], max_new_tokens=12, num_steps=2 + i)).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert [results[i] for i in range(len(prompts))] == solo


def test_cli_generate_json(stack: ServiceStack) -> None:
    proc = subprocess.run([sys.executable, "-m", "specsplit.cli", "generate", PROMPT, "--addr", stack.addr("gateway"),
                           "--max-new-tokens", "8", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("text", "token_ids", "tokens_per_s", "mean_accepted_length", "cycles"):
        assert key in out
    assert len(out["token_ids"]) == out["completion_tokens"] > 0


def test_cli_reports_errors_without_traceback(stack: ServiceStack) -> None:
    proc = subprocess.run([sys.executable, "-m", "specsplit.cli", "generate", PROMPT, "--addr", stack.addr("gateway"),
                           "--max-new-tokens", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "INVALID_ARGUMENT" in proc.stderr and "Traceback" not in proc.stderr


def test_logs_have_no_tracebacks(stack: ServiceStack) -> None:
    assert stack.cfg.log_dir is not None
    for log in Path(stack.cfg.log_dir).glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name


def test_stream_interval_gathers_tokens_and_loses_none(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    """--stream-interval 5: the first token alone, then messages of at least 5 tokens (the last
    one may be shorter), the same tokens and text as streaming every cycle."""
    cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=256, log_dir=tmp_path,
                         extra_gateway_args=["--stream-interval", "5"])
    with ServiceStack(cfg) as s:
        c = GatewayClient(s.addr("gateway"))
        try:
            for steps in (0, 3):
                chunks: list[int] = []
                gen = c.generate(make_request(token_ids=[5, 6, 7], max_new_tokens=29, ignore_eos=True,
                                              num_steps=steps, speculation=steps > 0),
                                 on_chunk=lambda m, chunks=chunks: chunks.append(len(m.token_ids)))
                sizes = [n for n in chunks if n]
                assert len(gen.token_ids) == 29 and sum(sizes) == 29
                assert sizes[0] == 1 and all(n >= 5 for n in sizes[1:-1]), sizes
                if steps == 0:
                    base = gen.token_ids
                else:
                    assert gen.token_ids == base
        finally:
            c.close()


def test_inline_steps_give_the_same_tokens(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    """--inline-steps (steps on the services' event loops, no engine thread) changes latency only."""
    cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=256, log_dir=tmp_path,
                         extra_target_args=["--inline-steps"], extra_draft_args=["--inline-steps"])
    with ServiceStack(cfg) as s:
        c = GatewayClient(s.addr("gateway"))
        try:
            base = c.generate(make_request(token_ids=[5, 6, 7], max_new_tokens=24, speculation=False))
            spec = c.generate(make_request(token_ids=[5, 6, 7], max_new_tokens=24, num_steps=4))
        finally:
            c.close()
        assert spec.token_ids == base.token_ids and len(base.token_ids) > 0
        assert spec.final.speculation.cycles > 0
        t, d = wait_idle(s)
        assert t.active_sequences == 0 and d.active_sequences == 0


def test_gateway_config_rejects_a_bad_stream_interval() -> None:
    from gateway.config import GatewayConfig

    for bad in (0, -1, 5000):
        with pytest.raises(ValueError, match="stream_interval"):
            GatewayConfig(stream_interval=bad).validate()
    assert GatewayConfig(stream_interval=16).validate().stream_interval == 16


def test_gateway_config_rejects_a_bad_step_timeout() -> None:
    from gateway.__main__ import parse_args
    from gateway.config import GatewayConfig

    for bad in (0.0, -1.0, 7200.0):
        with pytest.raises(ValueError, match="step_timeout_s"):
            GatewayConfig(step_timeout_s=bad).validate()
    assert parse_args(["--step-timeout", "2.5"]).step_timeout_s == 2.5
