"""The fused head step (specsplit.models.fused_head) computes what Eagle3Head.forward computes on a
padded batch: an extend of the target's features (causal) and a draft tree's level (each node
sees the committed entries, its ancestors' and its own), and the draft's fused tree levels. On a
GPU; on the CPU under the Triton interpreter too (TRITON_INTERPRET=1, float32 only; the
interpreter needs numpy < 2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from draft_service.config import DraftConfig
from draft_service.tree import grow_trees
from gateway.local import LocalEngines
from gateway.scheduler import GenerationRequest
from specsplit.models.batch import Batch
from specsplit.models.config import Eagle3Config
from specsplit.models.eagle3 import Eagle3Head
from specsplit.ops import Sampling
from target_service.config import TargetConfig
from tests.test_lossless import TINY_PROMPTS, check_lossless

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEV == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.quick, *([] if INTERPRETED else [pytest.mark.gpu])]


def _head(dtype: torch.dtype) -> Eagle3Head:
    if INTERPRETED and dtype != torch.float32:
        pytest.skip("the Triton interpreter's bfloat16 arithmetic is not the GPU's")
    cfg = Eagle3Config(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32,
                       vocab_size=600, draft_vocab_size=300, target_hidden_size=128, rope_theta=10000.0,
                       rms_norm_eps=1e-5, max_position=512)
    torch.manual_seed(0)
    with torch.device(DEV):
        head = Eagle3Head(cfg).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return head.to(dtype)


def _both(head: Eagle3Head, tokens: torch.Tensor, batch: Batch) -> tuple[tuple[torch.Tensor, ...], ...]:
    """(logits, pre-norm states, keys, values) of the head and of the fused step (its multi-row
    projections, then kernels.few's), each on a cache of its own holding the same committed entries."""
    from specsplit.models.fused_head import FusedHead

    first = head.new_cache(5, 64)
    g = torch.Generator().manual_seed(1)
    for kv in (first.k, first.v):
        kv.copy_(torch.randn(kv.shape, generator=g).to(kv))
    outs = []
    for fn in (head.forward, FusedHead(head, few_rows=0).forward, FusedHead(head, few_rows=8).forward):
        cache = head.new_cache(5, 64)
        cache.k.copy_(first.k)
        cache.v.copy_(first.v)
        with torch.inference_mode():
            logits, prenorm = fn(tokens, batch, cache)
        outs.append((logits, prenorm, cache.k, cache.v))
    return tuple(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "t"), [(2, 3), (3, 24)])  # 72 rows: two row tiles of the projections
def test_fused_head_extend_matches_the_head(dtype: torch.dtype, b: int, t: int) -> None:
    head = _head(dtype)
    starts = torch.tensor([5, 17, 30][:b], device=DEV)
    entries = starts[:, None] + torch.arange(t, device=DEV)  # [B, T]
    tokens = torch.randint(0, 600, (b * t,), device=DEV)
    features = torch.randn(b * t, 3 * 128, device=DEV).to(dtype)
    batch = Batch.padded(entries, torch.tensor([2, 0, 4][:b], device=DEV), entries, 64,
                         hidden=features.view(b, t, -1))
    want, *gots = _both(head, tokens, batch)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    for got in gots:
        for x, y in zip(want, got, strict=True):
            torch.testing.assert_close(y.float(), x.float(), **tol)


@pytest.mark.parametrize("t", [1, 3])
def test_fused_head_reads_the_engines_packed_inputs(t: int) -> None:
    """Four sequences whose tokens, positions, slots and entries are strided views of one integer
    tensor, as the draft engine's one host copy gives them ([B, 2T + 2]: tokens, positions, slot,
    first entry): each sequence reads its own slot and tokens."""
    head, b = _head(torch.float32), 4
    starts = torch.tensor([5, 17, 9, 30])
    slots = torch.tensor([[4], [0], [3], [1]])
    ints = torch.cat([torch.randint(0, 600, (b, t)), starts[:, None] + torch.arange(t), slots, starts[:, None]],
                     dim=1).to(DEV)  # [B, 2T + 2]
    positions, slots = ints[:, t : 2 * t], ints[:, 2 * t]
    features = torch.randn(b, t, 3 * 128, device=DEV)
    batch = Batch.padded(positions, slots, positions, 48, hidden=features)
    want, *gots = _both(head, ints[:, :t].reshape(b * t), batch)
    for got in gots:
        for x, y in zip(want, got, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_tree_level_matches_the_head(dtype: torch.dtype) -> None:
    """A second level of a topk-3 tree: each node sees the committed entries, one node of the
    first level (its parent) and itself."""
    head = _head(dtype)
    b, k, ctx = 2, 3, 32
    lengths = torch.tensor([6, 11], device=DEV)
    entries = lengths[:, None] + k + torch.arange(k, device=DEV)  # the level after the first
    keys = torch.arange(ctx, device=DEV)
    parent = lengths[:, None] + torch.tensor([[0, 0, 2], [1, 2, 2]], device=DEV)  # [B, K] first-level entries
    visible = ((keys < lengths[:, None, None]) | (keys == parent[..., None]) | (keys == entries[..., None]))
    positions = (lengths + 1)[:, None].expand(b, k)
    tokens = torch.randint(0, 600, (b * k,), device=DEV)
    prenorm = torch.randn(b, k, 128, device=DEV).to(dtype)
    batch = Batch.padded(positions, torch.tensor([1, 2], device=DEV), entries, ctx, visible=visible, hidden=prenorm)
    want, *gots = _both(head, tokens, batch)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    for got in gots:
        for x, y in zip(want, got, strict=True):
            torch.testing.assert_close(y.float(), x.float(), **tol)


@pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["on", "off"])
def test_draft_with_and_without_the_fused_head_is_lossless_fp32(tiny_target: Path, tiny_head: Path,
                                                               mode: str) -> None:
    """The draft service's --fused-head on: its extends and tree levels run the fused step (in CUDA
    graphs); off: the padded path. Speculation stays lossless either way, chains and trees."""
    engines = LocalEngines(TargetConfig(model=str(tiny_target), device="cuda", dtype="float32",
                                        hidden_backend="cuda_ipc", max_context=256),
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), device="cuda", dtype="float32",
                                       max_context=256, fused_head=mode))
    try:
        assert engines.draft is not None
        assert (engines.draft.engine.runner.fused_head is not None) == (mode == "on")
        path = "the fused head" if mode == "on" else "the padded path"
        assert engines.draft.engine.step_path == f"{path}, CUDA graphs"
        taus = check_lossless(engines, TINY_PROMPTS[:2], 16, {511}, range(3, 4), replay_rate=0.8)
        assert sum(taus) / len(taus) > 1.5
        base = engines.generate([GenerationRequest(p, 16, Sampling(), set(), 0) for p in TINY_PROMPTS[:2]])
        trees = engines.generate([GenerationRequest(p, 16, Sampling(), set(), 4, 3, 8) for p in TINY_PROMPTS[:2]])
        assert [r.tokens for r in trees] == [r.tokens for r in base]
    finally:
        engines.close()


@pytest.mark.parametrize("topk,steps", [(1, 4), (2, 3), (4, 5), (8, 3)])
def test_fused_tree_level_grows_the_same_trees(topk: int, steps: int) -> None:
    """grow_trees with a level's bookkeeping in one kernel (kernels.tree.tree_level) grows what
    the unfused levels grow: candidates, scores' order, parents, and each level's inputs,
    entries, positions and views."""
    from specsplit.models.kernels.tree import tree_level
    from tests.test_tree import FakeHead

    head, g = FakeHead(), torch.Generator().manual_seed(topk * 10 + steps)
    logits, hidden = torch.randn(3, 40, generator=g).to(DEV), torch.randn(3, 6, generator=g).to(DEV)
    head.tok, head.mix, head.emb = head.tok.to(DEV), head.mix.to(DEV), head.emb.to(DEV)
    lengths, slots = torch.tensor([5, 9, 1], device=DEV), torch.tensor([2, 0, 1], device=DEV)
    d2t = 2 * torch.arange(40, device=DEV) + 1  # FakeHead's ids map to 3·id + 1

    def level(*args: torch.Tensor | int) -> tuple[torch.Tensor, ...]:
        lp, ids, *rest = args
        return tree_level(lp, ids, d2t, *rest)  # type: ignore[arg-type]

    grown, seen = [], []
    for fused in (None, level):
        head.seen = []
        grown.append(grow_trees(head.forward, head.to_target_ids, logits, hidden, lengths, slots, topk, steps, 40,
                                fused_level=fused))
        seen.append(head.seen)
    for x, y in zip(*grown, strict=True):
        assert torch.equal(x, y)
    for (p0, e0, v0), (p1, e1, v1) in zip(*seen, strict=True):
        assert torch.equal(p0, p1) and torch.equal(e0, e1) and torch.equal(v0, v1)
