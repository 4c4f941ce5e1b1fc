"""`--compile` (target and draft): the runner's padded forward fused by torch.compile computes
what the eager padded forward computes (CPU: inductor's C++ backend; GPU: Triton, inside CUDA graphs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_service.config import DraftConfig
from draft_service.runtime import build_head
from draft_service.tree import grow_trees
from gateway.local import LocalEngines
from specsplit.models.eagle3 import Eagle3Head
from specsplit.models.llama import LlamaModel
from specsplit.runner.runner import ModelRunner
from target_service.config import TargetConfig
from tests.test_gpu_services import TINY_PROMPTS, needs_gpus
from tests.test_lossless import check_lossless
from tests.test_static_batches import tiny_model


def runners(model: LlamaModel | Eagle3Head) -> tuple[ModelRunner, ModelRunner]:
    """The same model under an eager and a compiled runner, each with a cache of its own."""
    return ModelRunner(model, 3, 64), ModelRunner(model, 3, 64, compile=True)


@pytest.mark.slow
def test_compiled_padded_forward_matches_eager_on_two_shapes(tiny_target: Path) -> None:
    eager, compiled = runners(tiny_model(tiny_target))
    g = torch.Generator().manual_seed(0)
    for b, t, ctx, start in ((2, 3, 16, 5), (3, 1, 32, 20)):  # a verify-like and a decode-like batch
        tokens = torch.randint(0, 500, (b, t), generator=g)
        positions = torch.arange(t).repeat(b, 1) + start
        slots = torch.arange(b)
        outs = []
        for r in (eager, compiled):
            with r.mode():
                outs.append(r.padded_forward(tokens, positions, slots, positions, ctx, capture=True))
        for x, y in zip(*outs, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(compiled.cache.k, eager.cache.k, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_head_padded_forward_matches_eager(tiny_target: Path, tiny_head: Path) -> None:
    head = build_head(DraftConfig(head=str(tiny_head), target=str(tiny_target)))
    eager, compiled = runners(head)
    g = torch.Generator().manual_seed(0)
    width = 3 * head.cfg.target_hidden_size
    for b, t, w, ctx, start in ((2, 4, width, 16, 0), (2, 1, head.cfg.hidden_size, 16, 4)):  # extend, proposal
        tokens = torch.randint(0, 500, (b, t), generator=g)
        hidden = torch.randn(b, t, w, generator=g)
        positions = torch.arange(t).repeat(b, 1) + start
        slots = torch.arange(b)
        outs = []
        for r in (eager, compiled):
            with r.mode():
                outs.append(r.padded_forward(tokens, positions, slots, positions, ctx, hidden=hidden))
        for x, y in zip(*outs, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_tree_growth_grows_the_eager_trees(tiny_target: Path, tiny_head: Path) -> None:
    """The draft's device-side proposal (grow_trees: tree masks, separate KV entries and
    rotary positions) through the compiled head forward builds the same trees."""
    head = build_head(DraftConfig(head=str(tiny_head), target=str(tiny_target)))
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, head.cfg.draft_vocab_size, generator=g)
    hidden = torch.randn(2, head.cfg.hidden_size, generator=g)
    lengths, slots = torch.tensor([5, 9]), torch.tensor([0, 1])
    grown = []
    for r in runners(head):

        def forward(tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    ctx: int, entries: torch.Tensor, visible: torch.Tensor, r: ModelRunner = r) -> tuple:
            return r.padded_forward(tokens, positions, slots, entries, ctx, visible=visible, hidden=hidden)

        with r.mode():
            grown.append(grow_trees(forward, head.to_target_ids, logits, hidden, lengths, slots, 3, 4, 32))
    for x, y in zip(*grown, strict=True):
        assert torch.equal(x, y)


@pytest.mark.gpu
@needs_gpus(1)
def test_compiled_engine_in_cuda_graphs_is_lossless_fp32(tiny_target: Path, tiny_head: Path) -> None:
    engines = LocalEngines(TargetConfig(model=str(tiny_target), device="cuda", dtype="float32",
                                        hidden_backend="cuda_ipc", max_context=256, compile=True,
                                        fused_decode="off"),  # compile serves the padded path
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), device="cuda", dtype="float32",
                                       max_context=256, compile=True))
    try:
        taus = check_lossless(engines, TINY_PROMPTS, 24, {511}, range(2, 5, 2), replay_rate=0.8)
        assert engines.target.engine.runner.graphs.replays > 0 and sum(taus) / len(taus) > 1.5
    finally:
        engines.close()


@pytest.mark.gpu
@needs_gpus(1)
def test_draft_cycle_graphs_compiled_whole_are_lossless_fp32(tiny_target: Path, tiny_head: Path) -> None:
    """The draft's --compile on CUDA: each cycle graph (extend, proposal steps, fused top-k)
    compiled whole before capture; speculation stays lossless."""
    engines = LocalEngines(TargetConfig(model=str(tiny_target), device="cuda", dtype="float32",
                                        hidden_backend="cuda_ipc", max_context=256),
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), device="cuda", dtype="float32",
                                       max_context=256, compile=True))
    try:
        assert engines.draft is not None and engines.draft.engine.runner.graphs.compile
        assert engines.draft.engine.runner.fused_head is None  # --fused-head auto: the padded path, compiled
        taus = check_lossless(engines, TINY_PROMPTS[:2], 16, {511}, range(3, 4), replay_rate=0.8)
        assert sum(taus) / len(taus) > 1.5
    finally:
        engines.close()
