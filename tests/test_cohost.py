"""Target and draft services co-hosted in one process (specsplit.cli.cohost): two services on
their own ports and step sockets, the gateway in front as with two processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig, free_port
from specsplit.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.test_gpu_services import run_stack

PROMPT = "Write a Python function that returns the sum of a list."


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> ServiceStack:
    cfg = StackConfig.of(model="smollm2", max_context=512, max_sequences=2, num_steps=3, cohost=True,
                         log_dir=tmp_path_factory.mktemp("logs"))
    with ServiceStack(cfg) as s:
        yield s


def test_one_process_serves_both_services(stack: ServiceStack) -> None:
    assert set(stack.procs) == {"target", "gateway"}
    with grpc.insecure_channel(stack.addr("target")) as t, grpc.insecure_channel(stack.addr("draft")) as d:
        target = target_pb2_grpc.TargetServiceStub(t).Stats(target_pb2.TargetStatsRequest(), timeout=10)
        draft = draft_pb2_grpc.DraftServiceStub(d).Stats(draft_pb2.DraftStatsRequest(), timeout=10)
    assert target.free_kv_slots > 0 and draft.free_kv_slots > 0
    assert "cohost" in stack.commands["target"][0]


@pytest.mark.parametrize("shape", [{"num_steps": 3}, {"num_steps": 3, "topk": 4, "num_draft_tokens": 16}])
def test_cohosted_speculation_equals_target_only(client: GatewayClient, shape: dict[str, int]) -> None:
    base = client.generate(make_request(PROMPT, max_new_tokens=32, speculation=False))
    spec = client.generate(make_request(PROMPT, max_new_tokens=32, **shape))
    assert spec.token_ids == base.token_ids and spec.text == base.text
    s = spec.final.speculation
    assert s.enabled and s.cycles < len(spec.token_ids)  # the shipped head's drafts were accepted


@pytest.mark.parametrize("argv, message", [
    (["--port", "5000"], "the draft's flags follow `--`"),
    (["--tp-size", "2", "--"], "a co-hosted target runs at --tp-size 1, not 2"),
    (["--", "--max-topk", "0"], "max_topk must be >= 1"),
])
def test_a_cohost_configuration_error_exits_without_a_traceback(argv: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "specsplit.cli.cohost", *argv], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "cohost: configuration error" in r.stderr


def test_the_demo_runs_cohosted(tmp_path) -> None:  # noqa: ANN001
    ports = [str(free_port()) for _ in range(3)]
    proc = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "demo", "What is 2 + 2?", "--max-new-tokens", "12", "--cohost",
         "--gateway-port", ports[0], "--target-port", ports[1], "--draft-port", ports[2], "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "outputs identical" in proc.stdout
    assert (tmp_path / "target.log").exists() and not (tmp_path / "draft.log").exists()  # one process for both


def test_cohost_needs_a_draft_at_tp1() -> None:
    r = subprocess.run([sys.executable, "-m", "specsplit.cli", "up", "--cohost", "--no-draft"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "--cohost needs a draft service and --tp-size 1" in r.stderr, r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cohosted_on_cuda_gives_the_tokens_of_two_processes(tiny_target: Path, tiny_head: Path,
                                                            tmp_path: Path) -> None:
    """fp32 on one GPU: the draft reading the ring in place (co-hosted) or through CUDA IPC (its
    own process) drafts the same, and greedy speculation equals target-only either way."""
    specs = [([1, 2, 3], {"num_steps": 3}), ([5] * 12, {"speculation": False}),
             (list(range(30, 70)), {"num_steps": 5}), ([9, 8, 7], {"num_steps": 3, "topk": 2, "num_draft_tokens": 6})]
    reqs = [make_request(token_ids=p, max_new_tokens=24, **shape) for p, shape in specs]
    base = {"model": str(tiny_target), "head": str(tiny_head), "max_context": 256, "device": "cuda:0",
            "hidden_backend": "cuda_ipc"}
    apart = run_stack(StackConfig.of(**base, log_dir=tmp_path / "apart"), reqs)
    together = run_stack(StackConfig.of(**base, cohost=True, log_dir=tmp_path / "cohost"), reqs)
    target_only = run_stack(StackConfig.of(**base, cohost=True, log_dir=tmp_path / "target-only"),
                            [make_request(token_ids=p, max_new_tokens=24, speculation=False) for p, _ in specs])
    assert together == apart == target_only
