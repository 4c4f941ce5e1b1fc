"""EAGLE-3 capture-layer wiring: the target captures the layers the head names, and a
mismatch disables speculation instead of silently ruining acceptance."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from specsplit.checkpoints.eagle_head import random_head, save_head
from specsplit.checkpoints.target_checkpoint import load_target_config
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.v1 import target_pb2, target_pb2_grpc


@pytest.fixture(scope="module")
def head_with_ids(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wired") / "head"
    cfg, weights = random_head(load_target_config(tiny_target), draft_vocab_size=256, seed=5,
                               aux_layer_ids=[0, 2, 3])
    save_head(out, cfg, weights)
    return out


def describe(addr: str) -> target_pb2.TargetInfo:
    with grpc.insecure_channel(addr) as ch:
        return target_pb2_grpc.TargetServiceStub(ch).Describe(target_pb2.TargetDescribeRequest(), timeout=10)


def test_target_captures_the_heads_layer_ids(tiny_target: Path, head_with_ids: Path, tmp_path: Path) -> None:
    with ServiceStack(StackConfig.of(model=str(tiny_target), head=str(head_with_ids), max_context=256,
                                     log_dir=tmp_path)) as stack:
        assert list(describe(stack.addr("target")).aux_layer_ids) == [0, 2, 3]
        client = GatewayClient(stack.addr("gateway"))
        assert client.model_info().draft_available
        out = client.generate(make_request(token_ids=[1, 2, 3], max_new_tokens=8, num_steps=3))
        assert out.final.speculation.enabled
        client.close()


def test_mismatched_layers_disable_speculation(tiny_target: Path, head_with_ids: Path, tmp_path: Path) -> None:
    cfg = StackConfig.of(model=str(tiny_target), head=str(head_with_ids), max_context=256, log_dir=tmp_path,
                         extra_target_args=["--aux-layer-ids", "1,2,3"])
    with ServiceStack(cfg) as stack:
        client = GatewayClient(stack.addr("gateway"))
        assert not client.model_info().draft_available
        out = client.generate(make_request(token_ids=[1, 2, 3], max_new_tokens=8, num_steps=3))
        assert not out.final.speculation.enabled and len(out.token_ids) > 0
        client.close()
    assert "trained on target layers [0, 2, 3]" in (tmp_path / "gateway.log").read_text()
