"""Tensor parallelism over gloo: TP2 gives the same tokens as TP1 (real processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.ranks import spawn_ranks
from specsplit.checkpoints.eagle_head import random_head, save_head
from specsplit.checkpoints.target_checkpoint import load_target_config
from specsplit.checkpoints.tiny import tiny_config, write_tiny_target
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.models.parallel import TensorParallel


def run_stack(cfg: StackConfig, requests: list) -> list[list[int]]:  # noqa: ANN001
    with ServiceStack(cfg) as stack:
        client = GatewayClient(stack.addr("gateway"))
        try:
            return [client.generate(r, timeout=300).token_ids for r in requests]
        finally:
            client.close()


def test_tiny_tp2_equals_tp1(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    reqs = [make_request(token_ids=p, max_new_tokens=24, num_steps=s)
            for p, s in [([1, 2, 3], 3), ([5] * 12, 0), (list(range(30, 70)), 5)]]
    base = dict(model=str(tiny_target), head=str(tiny_head), max_context=256, log_dir=tmp_path)
    tp1 = run_stack(StackConfig.of(**base), reqs)
    tp2 = run_stack(StackConfig.of(**base, tp_size=2), reqs)
    assert tp1 == tp2 and all(len(t) > 0 for t in tp1)
    # every rank goes on with a prompt in parts (the 40-token one in three)
    parts = run_stack(StackConfig.of(**base, tp_size=2, extra_gateway_args=["--prefill-chunk", "16"]), reqs)
    assert parts == tp1


@pytest.mark.slow
def test_smollm2_tp2_uneven_head_split_equals_tp1(tmp_path: Path) -> None:
    """SmolLM2 has 9 heads / 3 KV heads: on 2 ranks the KV groups split 2 + 1."""
    reqs = [make_request("What is the capital of France?", max_new_tokens=16, num_steps=2),
            make_request("Write a haiku about the sea.", max_new_tokens=16, speculation=False)]
    base = dict(model="smollm2", max_context=512, log_dir=tmp_path)
    tp1 = run_stack(StackConfig.of(**base), reqs)
    tp2 = run_stack(StackConfig.of(**base, tp_size=2), reqs)
    assert tp1 == tp2


def test_more_ranks_than_kv_heads_give_the_tp1_tokens(tmp_path: Path) -> None:
    """9 heads / 3 KV heads (SmolLM2's groups) on 4 and 8 ranks: past 3 ranks each KV group
    goes to ranks of its own, which split its query heads and each hold a copy of its KV head."""
    target = write_tiny_target(tmp_path / "target", tiny_config(hidden=72, heads=9, kv_heads=3, layers=3), seed=5)
    head_cfg, weights = random_head(load_target_config(target), draft_vocab_size=256, seed=6, std=0.2)
    save_head(tmp_path / "head", head_cfg, weights)
    reqs = [make_request(token_ids=p, max_new_tokens=16, num_steps=s)
            for p, s in [([1, 2, 3], 3), (list(range(30, 50)), 0)]]
    base = dict(model=str(target), head=str(tmp_path / "head"), max_context=128)
    tp1 = run_stack(StackConfig.of(**base, log_dir=tmp_path / "tp1"), reqs)
    for n in (4, 8):
        assert run_stack(StackConfig.of(**base, tp_size=n, log_dir=tmp_path / f"tp{n}"), reqs) == tp1, f"TP{n}"
    assert all(len(t) > 0 for t in tp1)


def test_target_only_without_a_draft_service(tiny_target: Path, tmp_path: Path) -> None:
    reqs = [make_request(token_ids=[1, 2, 3], max_new_tokens=10, num_steps=4)]
    out = run_stack(StackConfig.of(model=str(tiny_target), with_draft=False, max_context=256, log_dir=tmp_path), reqs)
    assert len(out[0]) > 0


def test_the_end_to_end_bench_runs_the_services_target_over_ranks(tiny_target: Path, tiny_head: Path,
                                                                  tmp_path: Path) -> None:
    """bench.end_to_end --tp-size 2: the services' target over two ranks decodes the in-process
    (one rank) tokens, and every services row says its TP size."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "bench.end_to_end", "--model", str(tiny_target), "--head",
                          str(tiny_head), "--device", "cpu", "--draft-device", "cpu", "--dtype", "float32",
                          "--prompts", "1", "--max-new-tokens", "12", "--num-steps", "2", "--hf-prompts", "0",
                          "--forced-acceptance", "shipped", "--tp-size", "2", "--variants", "thread"],
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    services = [r for r in rows if r.get("mode") == "services_thread"]
    assert {r["num_steps"] for r in services} == {0, 2} and all(r["tp_size"] == 2 for r in services)
    assert next(r for r in services if r["num_steps"] == 0)["same_tokens_as_in_process_target_only"] == 1.0
    assert rows[-1]["services_tp_size"] == 2


def _sum_of_ranks(out: str, tp: TensorParallel) -> None:
    x = tp.all_reduce(torch.full((2,), float(tp.rank + 1)))
    if tp.rank == 0:
        Path(out).write_text(json.dumps(x.tolist()))


def _rank_one_fails(_: None, tp: TensorParallel) -> None:
    if tp.rank == 1:
        raise ValueError("rank one fails")
    tp.all_reduce(torch.ones(1))  # waits for rank 1 until stopped


def test_bench_ranks_run_a_body_on_every_rank_and_report_a_failed_one(tmp_path: Path) -> None:
    """bench.ranks (the benches' --tp-size): the body runs on 3 ranks joined over gloo; a rank
    that fails stops the group with its traceback instead of leaving the others waiting."""
    spawn_ranks(_sum_of_ranks, 3, str(tmp_path / "sum"), device="cpu")
    assert json.loads((tmp_path / "sum").read_text()) == [6.0, 6.0]
    with pytest.raises(RuntimeError, match="rank one fails"):
        spawn_ranks(_rank_one_fails, 2, None, device="cpu")
