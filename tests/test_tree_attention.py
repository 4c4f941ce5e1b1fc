"""The fused step's attention (specsplit.models.kernels.verify.tree_attention) against attention
written out in torch: batches of decodes and of trees at contexts from none to several ranges of
keys, under masks and under a draft level's visible rows, a kv head's query heads as one tile's
rows or one head a program, the new keys and values stored at their entries. On a GPU; on the
CPU under the Triton interpreter too (TRITON_INTERPRET=1, float32 only)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from specsplit.models.batch import tree_ancestry
from tests.test_packing import random_tree

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEV == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.quick, *([] if INTERPRETED else [pytest.mark.gpu]),
              pytest.mark.skipif(DEV == "cpu" and not INTERPRETED, reason="needs a GPU or TRITON_INTERPRET=1")]
DTYPES = [torch.float32] if INTERPRETED else [torch.float32, torch.bfloat16]
HQ, HKV, D = 9, 3, 64


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] at rows of cos, sin [..., D]: x·cos + rotate_half(x)·sin (sin signed), rounded as the kernels."""
    xf = x.float()
    xr = torch.cat([xf[..., D // 2:], xf[..., :D // 2]], -1)
    return ((xf * cos).to(x.dtype).float() + xr * sin).to(x.dtype)


def _reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               starts: list[int], slots: torch.Tensor, sees_new: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, sees_committed: torch.Tensor | None = None) -> torch.Tensor:
    """Each token over its slot's committed entries (those sees_committed [B, T, ≥ start] shows;
    all without it) and the new tokens sees_new [B, T, T] shows (and itself), in float32; stores
    the new keys and values in the caches."""
    b, t = sees_new.shape[:2]
    out = torch.empty(b * t, HQ * D, device=qkv.device, dtype=qkv.dtype)
    group = HQ // HKV
    for s, start in enumerate(starts):
        rows = qkv[s * t:(s + 1) * t]  # [T, (HQ + 2 HKV) D]
        at = positions[s * t:(s + 1) * t]
        c, sn = cos[at].to(qkv.dtype).float(), sin[at].to(qkv.dtype).float()  # [T, D], the tables in the step's dtype
        q = _rotate(rows[:, :HQ * D].view(t, HQ, D), c[:, None], sn[:, None])  # [T, HQ, D]
        k = _rotate(rows[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D), c[:, None], sn[:, None])  # [T, HKV, D]
        v = rows[:, (HQ + HKV) * D:].view(t, HKV, D)
        slot = int(slots[s])
        k_cache[slot, start:start + t], v_cache[slot, start:start + t] = k, v
        keys, values = k_cache[slot, :start + t].float(), v_cache[slot, :start + t].float()  # [start + T, HKV, D]
        sees = torch.ones(t, start + t, dtype=torch.bool, device=qkv.device)
        if sees_committed is not None:
            sees[:, :start] = sees_committed[s, :, :start].bool()
        sees[:, start:] = sees_new[s].bool() | torch.eye(t, dtype=torch.bool, device=qkv.device)
        for h in range(HQ):
            scores = q[:, h].float() @ keys[:, h // group].T * D ** -0.5  # [T, start + T]
            p = scores.masked_fill(~sees, float("-inf")).softmax(-1)
            out[s * t:(s + 1) * t, h * D:(h + 1) * D] = (p @ values[:, h // group]).to(qkv.dtype)
    return out


def _step(t: int, dtype: torch.dtype, seed: int) -> dict[str, object]:
    """Sequences at contexts 0, 1, a block, past it and several ranges, their tokens a random tree
    each (T = 1: a batch of decodes) at their depths' rotary positions, slots not in the rows'
    order."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    starts = [0, 1, 63, 64, 130, 300, 517]
    b = len(starts)
    trees = [tree_ancestry(random_tree(rng, t), t) for _ in starts]  # (mask rows [T, T], depths)
    angles = torch.arange(1024)[:, None] * torch.linspace(0.01, 1.0, D)[None, :]
    return dict(
        starts=starts, qkv=torch.randn(b * t, (HQ + 2 * HKV) * D, generator=gen).to(DEV, dtype),
        cos=angles.cos().to(DEV), sin=angles.sin().to(DEV),
        positions=torch.tensor([s + d for s, (_, depths) in zip(starts, trees, strict=True) for d in depths],
                               device=DEV),
        entries=torch.tensor([[s + i for i in range(t)] for s in starts], device=DEV),
        slots=torch.arange(b, 0, -1, device=DEV),
        mask=torch.tensor(np.stack([m for m, _ in trees]).astype(bool), device=DEV),
        k_cache=torch.randn(b + 1, 600, HKV, D, generator=gen).to(DEV, dtype),
        v_cache=torch.randn(b + 1, 600, HKV, D, generator=gen).to(DEV, dtype), gen=gen)


def _check(step: dict, dtype: torch.dtype, visible: torch.Tensor | None = None) -> None:
    """The kernel against the reference with one key range and with four (sms decides), the
    counters back at zero, the new keys within a rounding of the rotation's multiply-add (one
    rounding on the GPU where torch rounds twice) and the new values bit for bit."""
    from specsplit.models.kernels import verify

    b, t = step["entries"].shape
    k_ref, v_ref = step["k_cache"].clone(), step["v_cache"].clone()
    sees_new = step["mask"] if visible is None else torch.stack(
        [visible[s, :, start:start + t] for s, start in enumerate(step["starts"])])
    want = _reference(step["qkv"], step["cos"], step["sin"], step["positions"], step["starts"], step["slots"],
                      sees_new, k_ref, v_ref, visible)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    close = dict(atol=1e-5, rtol=0.0) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    counters = torch.zeros(b * HQ, dtype=torch.int32, device=DEV)
    for sms in (1, 1000):
        k_step, v_step = step["k_cache"].clone(), step["v_cache"].clone()
        got = verify.tree_attention(step["qkv"], step["cos"], step["sin"], step["positions"], step["entries"],
                                    step["slots"], None if visible is not None else step["mask"], k_step, v_step,
                                    HQ, HKV, counters, sms, visible=visible)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(k_step, k_ref, **close)
        assert torch.equal(v_step, v_ref)
        assert not counters.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 4, 5, 16])
@pytest.mark.parametrize("grouped", [True, False], ids=["group", "head"])
def test_tree_attention_computes_what_torch_does(dtype: torch.dtype, t: int, grouped: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from specsplit.models.kernels import verify

    if not grouped:
        monkeypatch.setattr(verify, "query_heads", lambda tokens, heads, kv_heads: 1)
    _check(_step(t, dtype, t), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 4])
def test_tree_attention_with_visible_rows_computes_what_torch_does(dtype: torch.dtype, t: int) -> None:
    """A draft tree level's attention: each token sees the entries its row of `visible` names,
    committed (a random half here) and new (its ancestors' and its own)."""
    step = _step(t, dtype, 10 + t)
    b, ctx = len(step["starts"]), 600
    visible = torch.rand(b, t, ctx, generator=step["gen"]) < 0.5
    for s, start in enumerate(step["starts"]):
        visible[s, :, start:start + t] = step["mask"][s].cpu()
        visible[s, :, start + t:] = False
    _check(step, dtype, visible.to(DEV))


def test_a_kv_heads_group_shares_a_tile_while_its_rows_fit() -> None:
    from specsplit.models.kernels import verify

    assert verify.query_heads(1, 9, 3) == 3 and verify.query_heads(5, 9, 3) == 3
    assert verify.query_heads(6, 9, 3) == 1  # 18 rows: past the smallest tile
    assert verify.query_heads(4, 32, 8) == 4 and verify.query_heads(5, 32, 8) == 1
    assert verify.query_heads(1, 32, 32) == 1
