"""Forced acceptance (gateway.forced), a benchmark mode: drawn from a per-depth profile,
committed by a target that allows it, refused by one that does not, absent from `specsplit up`."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from gateway.forced import SHIPPED_PROFILE, ForcedAcceptance
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.models.batch import tree_ancestry
from specsplit.runner.acceptance import ALWAYS, accept, row_fields


def test_profiles_parse_and_bad_ones_are_refused() -> None:
    assert ForcedAcceptance.parse("") is None
    assert ForcedAcceptance.parse("shipped") == ForcedAcceptance(SHIPPED_PROFILE)
    assert ForcedAcceptance.parse("0.5,0.7").rates == (0.5, 0.7)
    for bad in ("1.5", "x", "0.5,,0.7"):
        with pytest.raises(ValueError, match="forced acceptance"):
            ForcedAcceptance.parse(bad)


def test_draws_follow_the_profile() -> None:
    rng = random.Random(0)
    assert {ForcedAcceptance((1.0,)).draw(rng, 5) for _ in range(50)} == {5}
    assert {ForcedAcceptance((0.0,)).draw(rng, 5) for _ in range(50)} == {0}
    f = ForcedAcceptance((0.9, 0.5))  # depth 1 at 0.9, every deeper one at 0.5
    draws = [f.draw(rng, 3) for _ in range(20000)]
    p = [sum(d >= i for d in draws) / len(draws) for i in (1, 2, 3)]
    assert p == pytest.approx([0.9, 0.45, 0.225], abs=0.015)


def forced_path(parents: list[int] | None, forced: int, t: int = 8) -> list[int]:
    """The nodes the device accepts for a forced row of the last token and drafts 1, 2, ...
    (parents: the drafts' as the gateway sends them; None: four drafts in a chain) when the
    target's argmax matches no draft."""
    nodes = None if parents is None else [-1, *(p + 1 for p in parents)]
    tokens = list(range(5 if parents is None else len(parents) + 1))
    parent, expect = row_fields(tokens, nodes, True, t, forced)
    ancestors = torch.from_numpy(tree_ancestry(tuple(parent), t)[0]).bool()[None]  # [1, t, t]
    path, count = accept(torch.full((1, t), 7), torch.tensor([expect]), torch.tensor([parent]), ancestors)
    return path[0, : int(count[0])].tolist()


def test_forced_rows_accept_the_drawn_drafts_down_the_deepest_path() -> None:
    assert forced_path(None, 2) == [0, 1, 2]  # a chain: the first two drafts
    assert forced_path(None, 9) == [0, 1, 2, 3, 4]  # at most all of them
    # a tree: 1 and 2 under the last token, 3 under 1, 4 under 3
    assert forced_path([-1, -1, 0, 2], 2) == [0, 1, 3]
    assert forced_path([-1, -1, 0, 2], 5) == [0, 1, 3, 4]  # to a leaf
    assert forced_path([-1, -1, 0, 2], 0) == [0]
    assert forced_path([-1, -1, 1], 2) == [0, 2, 3]  # 1 is a leaf: the path under 2 goes deeper
    _, expect = row_fields([0, 1, 2], None, True, 4, forced=1)
    assert expect == [-1, ALWAYS, -1, -1]  # the rest, and padding, never


def forced_stack(tiny_target: Path, tiny_head: Path, tmp_path: Path, target_allows: bool) -> ServiceStack:
    return ServiceStack(StackConfig.of(
        model=str(tiny_target), head=str(tiny_head), max_context=256, log_dir=tmp_path,
        extra_gateway_args=["--benchmark-forced-acceptance", "1.0"],
        extra_target_args=["--benchmark-forced-acceptance"] if target_allows else []))


def test_every_verify_accepts_what_the_profile_says(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    with forced_stack(tiny_target, tiny_head, tmp_path, target_allows=True) as stack:
        client = GatewayClient(stack.addr("gateway"))
        try:
            info = client.model_info()
            chain = client.generate(make_request(token_ids=[1, 2, 3], max_new_tokens=33, num_steps=3,
                                                 ignore_eos=True)).final.speculation
            tree = client.generate(make_request(token_ids=[1, 2, 3], max_new_tokens=25, num_steps=4, topk=2,
                                                num_draft_tokens=8, ignore_eos=True)).final.speculation
        finally:
            client.close()
    assert "forced acceptance 1" in info.draft_name
    assert list(chain.accepted_length_histogram) == [0, 0, 0, 0, chain.cycles]  # 3 drafts + 1, every cycle
    assert chain.mean_accepted_length == 4.0
    assert tree.mean_accepted_length > 3.0  # down the deepest path, to a leaf at most


def test_a_target_without_the_flag_refuses_it(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    with forced_stack(tiny_target, tiny_head, tmp_path, target_allows=False) as stack:
        client = GatewayClient(stack.addr("gateway"))
        try:
            with pytest.raises(grpc.RpcError) as e:
                client.generate(make_request(token_ids=[1, 2, 3], max_new_tokens=8, num_steps=2, ignore_eos=True))
        finally:
            client.close()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--benchmark-forced-acceptance" in (e.value.details() or "")


def test_specsplit_up_has_no_forced_acceptance() -> None:
    out = subprocess.run([sys.executable, "-m", "specsplit.cli", "up", "--benchmark-forced-acceptance", "shipped"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unrecognized arguments" in out.stderr
