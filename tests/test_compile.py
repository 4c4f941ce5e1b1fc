"""`--compile` (target and draft): the static forwards fused by torch.compile compute what the
eager static forwards compute (CPU: inductor's C++ backend; GPU: Triton, inside CUDA graphs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_service.config import DraftConfig
from draft_service.runtime import build_head
from draft_service.tree import grow_trees_static
from gateway.local import LocalEngines
from specsplit.models.cuda_graphs import compile_static
from target_service.config import TargetConfig
from tests.test_gpu_services import TINY_PROMPTS, needs_gpus
from tests.test_lossless import check_lossless
from tests.test_static_batches import tiny_model


@pytest.mark.slow
def test_compiled_static_forward_matches_eager_on_two_shapes(tiny_target: Path) -> None:
    model = tiny_model(tiny_target)
    compiled = compile_static(model.static_forward)
    g = torch.Generator().manual_seed(0)
    caches = [model.new_cache(4, 64), model.new_cache(4, 64)]
    for b, t, ctx, start in ((2, 3, 16, 5), (4, 1, 32, 20)):  # a verify-like and a decode-like batch
        tokens = torch.randint(0, 500, (b, t), generator=g)
        positions = torch.arange(t).repeat(b, 1) + start
        slots = torch.arange(b)
        ref = model.forward_static(tokens, positions, slots, ctx, caches[0], capture=True)
        with torch.no_grad():
            out = compiled(tokens, positions, slots, ctx, caches[1], capture=True)
        for x, y in zip(out, ref, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_head_static_forward_matches_eager(tiny_target: Path, tiny_head: Path) -> None:
    head = build_head(DraftConfig(head=str(tiny_head), target=str(tiny_target)))
    compiled = compile_static(head.static_forward)
    g = torch.Generator().manual_seed(0)
    caches = [head.new_cache(3, 64), head.new_cache(3, 64)]
    width = 3 * head.cfg.target_hidden_size
    for b, t, w, ctx, start in ((2, 4, width, 16, 0), (2, 1, head.cfg.hidden_size, 16, 4)):  # extend, proposal
        tokens = torch.randint(0, 500, (b, t), generator=g)
        hidden = torch.randn(b, t, w, generator=g)
        positions = torch.arange(t).repeat(b, 1) + start
        slots = torch.arange(b)
        ref = head.forward_static(tokens, hidden, positions, slots, ctx, caches[0])
        with torch.no_grad():
            out = compiled(tokens, hidden, positions, slots, ctx, caches[1])
        for x, y in zip(out, ref, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_tree_growth_grows_the_eager_trees(tiny_target: Path, tiny_head: Path) -> None:
    """The draft's device-side proposal (grow_trees_static: tree masks, separate KV entries and
    rotary positions) through the compiled head forward builds the same trees."""
    head = build_head(DraftConfig(head=str(tiny_head), target=str(tiny_target)))
    compiled = compile_static(head.static_forward)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, head.cfg.draft_vocab_size, generator=g)
    hidden = torch.randn(2, head.cfg.hidden_size, generator=g)
    lengths, slots = torch.tensor([5, 9]), torch.tensor([0, 1])
    grown = []
    for fn in (head.static_forward, compiled):
        cache = head.new_cache(3, 64)

        def forward(*args: torch.Tensor | int, fn=fn, cache=cache) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
            return fn(*args[:5], cache, *args[5:])

        with torch.no_grad():
            grown.append(grow_trees_static(forward, head.to_target_ids, logits, hidden, lengths, slots, 3, 4, 32))
    for x, y in zip(*grown, strict=True):
        assert torch.equal(x, y)


@pytest.mark.gpu
@needs_gpus(1)
def test_compiled_engine_in_cuda_graphs_is_lossless_fp32(tiny_target: Path, tiny_head: Path) -> None:
    engines = LocalEngines(TargetConfig(model=str(tiny_target), device="cuda", dtype="float32",
                                        hidden_backend="cuda_ipc", max_context=256, compile=True),
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), device="cuda", dtype="float32",
                                       max_context=256, compile=True))
    try:
        taus = check_lossless(engines, TINY_PROMPTS, 24, {511}, range(2, 5, 2), replay_rate=0.8)
        assert engines.target.engine.graphs.replays > 0 and sum(taus) / len(taus) > 1.5
    finally:
        engines.close()
