"""The verify's acceptance as one kernel (specsplit.models.kernels.accept) against the torch
operations it replaces (specsplit.runner.acceptance): the same readback, features along the path
and KV entries moved, for chains, trees, forced acceptance, padding rows and one-token rows. On a
GPU; on the CPU under the Triton interpreter too (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from specsplit.models.batch import tree_ancestry
from specsplit.models.layers import KVCache
from specsplit.runner.acceptance import ALWAYS, accept, compact, readback, row_fields

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEV == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.quick, *([] if INTERPRETED else [pytest.mark.gpu])]
needs_kernels = pytest.mark.skipif(DEV == "cpu" and not INTERPRETED, reason="needs a GPU or TRITON_INTERPRET=1")


def _step(seed: int, b: int, t: int, tree: bool) -> dict[str, torch.Tensor | None]:
    """A step's acceptance inputs as the runner packs them: b rows of up to t nodes."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    fields, masks = [], []
    for _ in range(b):
        n = rng.randint(1, t)  # rows shorter than t: padding after them
        parents = [-1, *(rng.randrange(j) for j in range(1, n))] if tree else None
        tokens = [rng.randrange(5) for _ in range(n)]
        forced = rng.choice([-1, -1, 0, 2, 5])
        fields.append(row_fields(tokens, parents, rng.random() < 0.8, t, forced))
        mask = torch.tril(torch.ones(t, t, dtype=torch.int64))
        if parents:
            mask[:n] = torch.as_tensor(tree_ancestry(tuple(parents), t)[0])
        masks.append(mask)
    return {"best": torch.randint(0, 5, (b, t)).to(DEV),  # few tokens: many matches
            "fields": torch.tensor(fields).transpose(0, 1).contiguous().transpose(0, 1).to(DEV),  # [2, B, T] viewed
            "mask": torch.stack(masks).to(DEV), "features": torch.randn(b, t, 40, device=DEV),
            # slots and starts strided as the runner's views of its packed integers give them
            "slots": torch.randperm(2 * b + 2, device=DEV).view(b + 1, 2)[:b, 1],
            "starts": torch.randint(0, 96, (b, t), device=DEV)[:, 0]}


@needs_kernels
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize(("b", "t"), [(1, 1), (1, 4), (2, 16), (3, 5), (1, 64)])
def test_the_kernel_accepts_what_the_torch_operations_do(tree: bool, b: int, t: int) -> None:
    from specsplit.models.kernels.accept import accept_rows

    for seed in range(20):
        s = _step(seed, b, t, tree)
        ours, theirs = (KVCache(3, 2 * b + 2, 160, 2, 8, torch.float32, DEV) for _ in range(2))
        theirs.k.normal_()
        theirs.v.normal_()
        ours.k.copy_(theirs.k)
        ours.v.copy_(theirs.v)
        fields, mask, best = s["fields"], s["mask"], s["best"]
        path, count = accept(best, fields[:, 1], fields[:, 0], mask)
        if tree:
            compact(theirs, s["slots"], s["starts"], path)
        features = s["features"].gather(1, path[..., None].expand(-1, -1, 40))
        got, got_features = accept_rows(best, fields, mask, ours.k, ours.v, s["slots"], s["starts"], s["features"],
                                        tree, ALWAYS)
        assert torch.equal(got, readback(count, path, best.gather(1, path)))
        assert got_features is not None and torch.equal(got_features, features)
        assert torch.equal(ours.k, theirs.k) and torch.equal(ours.v, theirs.v)


@needs_kernels
def test_chains_without_a_mask_accept_as_with_the_causal_one() -> None:
    from specsplit.models.kernels.accept import accept_rows

    s = _step(7, 3, 6, False)
    cache = KVCache(2, 8, 160, 2, 8, torch.float32, DEV)
    with_mask, _ = accept_rows(s["best"], s["fields"], s["mask"], cache.k, cache.v, s["slots"], s["starts"], None,
                               False, ALWAYS)
    without, _ = accept_rows(s["best"], s["fields"], None, cache.k, cache.v, s["slots"], s["starts"], None, False,
                             ALWAYS)
    assert torch.equal(with_mask, without)

