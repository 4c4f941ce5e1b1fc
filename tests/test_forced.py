"""Forced acceptance (specsplit.forced), a benchmark mode: drawn from a per-depth profile,
committed by a target that allows it, refused by one that does not, absent from `specsplit up`;
the draft's trees ranked by the profile, as deep as a trained head's."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from draft_service.config import DraftConfig
from draft_service.tree import grow_trees, tree_result
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.forced import RANK_FLOOR, SHIPPED_PROFILE, ForcedAcceptance
from specsplit.models.batch import tree_ancestry
from specsplit.runner.acceptance import ALWAYS, accept, row_fields
from tests.test_tree import FakeHead


def test_profiles_parse_and_bad_ones_are_refused() -> None:
    assert ForcedAcceptance.parse("") is None
    assert ForcedAcceptance.parse("shipped") == ForcedAcceptance(SHIPPED_PROFILE)
    assert ForcedAcceptance.parse("0.5,0.7").rates == (0.5, 0.7)
    for bad in ("1.5", "x", "0.5,,0.7"):
        with pytest.raises(ValueError, match="forced acceptance"):
            ForcedAcceptance.parse(bad)
        with pytest.raises(ValueError, match="forced acceptance"):
            DraftConfig(benchmark_tree_profile=bad).validate()


def test_rank_scores_give_the_best_child_the_rate_and_its_siblings_the_rest() -> None:
    ranks = ForcedAcceptance((0.8, 0.6)).rank_log_probs(3, 4)
    probs = [[math.exp(x) for x in row] for row in ranks]
    assert probs == [pytest.approx([0.8, 0.1, 0.05, 0.05]), pytest.approx([0.6, 0.2, 0.1, 0.1]),
                     pytest.approx([0.6, 0.2, 0.1, 0.1])]  # deeper depths repeat the last rate
    assert ForcedAcceptance((1.0,)).rank_log_probs(1, 2)[0] == pytest.approx([0.0, math.log(RANK_FLOOR)])
    assert ForcedAcceptance((0.5,)).rank_log_probs(2, 1) == [[math.log(0.5)]] * 2
    assert ForcedAcceptance((0.5,)).label_for(trees=True) == "forced acceptance 0.5, trees ranked by it"
    assert ForcedAcceptance((0.5,)).label_for(trees=False) == "forced acceptance 0.5"


def test_trees_ranked_by_the_shipped_profile_keep_a_chain_as_deep_as_their_steps() -> None:
    """A head whose scores are flat grows wide, shallow trees; ranked by the profile, the same
    head's tree keeps a chain down to its last level, with siblings along it (the tokens are
    still the head's top-k)."""
    head, g = FakeHead(), torch.Generator().manual_seed(3)
    logits, hidden = torch.randn(2, 40, generator=g) * 1e-3, torch.randn(2, 6, generator=g)  # flat scores
    lengths, slots = torch.tensor([5, 9]), torch.tensor([0, 1])
    ranks = torch.tensor(ForcedAcceptance(SHIPPED_PROFILE).rank_log_probs(5, 4))
    for ranked, widths in ((None, None), (ranks, [2, 3, 4, 3, 3])):
        head.seen.clear()
        tokens, parents, order = grow_trees(head.forward, head.to_target_ids, logits, hidden, lengths, slots, 4, 5,
                                            40, ranks=ranked)
        for b in range(2):
            _, tree = tree_result(tokens[b].tolist(), parents[b].tolist(), order[b].tolist(), 4, 5, 15)
            depth = [0] * len(tree)
            for j, p in enumerate(tree):
                depth[j] = 1 if p < 0 else depth[p] + 1
            if ranked is None:
                assert max(depth) <= 3
            else:  # nodes a depth, 1..5
                assert [depth.count(d) for d in range(1, 6)] == widths


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
        extra_target_args=["--benchmark-forced-acceptance"] if target_allows else [],
        extra_draft_args=["--benchmark-tree-profile", "1.0"]))


def test_every_verify_accepts_what_the_profile_says(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    with forced_stack(tiny_target, tiny_head, tmp_path, target_allows=True) as stack:
        client = GatewayClient(stack.addr("gateway"))
        try:
            info = client.model_info()
            chain = client.generate(make_request(token_ids=[1, 2, 3], max_new_tokens=33, num_steps=3,
                                                 ignore_eos=True)).final.speculation
            tree = client.generate(make_request(token_ids=[1, 2, 3], max_new_tokens=21, num_steps=4, topk=2,
                                                num_draft_tokens=8, ignore_eos=True)).final.speculation
        finally:
            client.close()
    assert "forced acceptance 1" in info.draft_name
    assert list(chain.accepted_length_histogram) == [0, 0, 0, 0, chain.cycles]  # 3 drafts + 1, every cycle
    assert chain.mean_accepted_length == 4.0
    # the draft's trees ranked by the profile hold a chain 4 deep: every cycle accepts it
    assert list(tree.accepted_length_histogram) == [0, 0, 0, 0, 0, tree.cycles]


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
    for benchmark_flag in ("--benchmark-forced-acceptance", "--benchmark-tree-profile"):
        out = subprocess.run([sys.executable, "-m", "specsplit.cli", "up", benchmark_flag, "shipped"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "unrecognized arguments" in out.stderr
