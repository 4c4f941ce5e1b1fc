"""The fused step's attention (specsplit.models.kernels.verify.tree_attention) against attention
written out in torch: batches of decodes, chains and trees at contexts from none to several
ranges of keys, a kv head's query heads as one tile's rows or one head a program, the new keys
and values stored at their entries. On a GPU; on the CPU under the Triton interpreter too
(TRITON_INTERPRET=1, float32 only)."""

from __future__ import annotations

import os

import pytest
import torch

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
               starts: list[int], slots: torch.Tensor, mask: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> torch.Tensor:
    """Each token over its slot's committed entries and the new tokens its mask row shows (and itself),
    in float32; stores the new keys and values in the caches."""
    b, t = mask.shape[:2]
    out = torch.empty(b * t, HQ * D, device=qkv.device, dtype=qkv.dtype)
    group = HQ // HKV
    for s, start in enumerate(starts):
        rows = qkv[s * t:(s + 1) * t]  # [T, (HQ + 2 HKV) D]
        c, sn = cos[positions[s * t:(s + 1) * t]].float(), sin[positions[s * t:(s + 1) * t]].float()  # [T, D]
        q = _rotate(rows[:, :HQ * D].view(t, HQ, D), c[:, None], sn[:, None])  # [T, HQ, D]
        k = _rotate(rows[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D), c[:, None], sn[:, None])  # [T, HKV, D]
        v = rows[:, (HQ + HKV) * D:].view(t, HKV, D)
        slot = int(slots[s])
        k_cache[slot, start:start + t], v_cache[slot, start:start + t] = k, v
        keys, values = k_cache[slot, :start + t].float(), v_cache[slot, :start + t].float()  # [start + T, HKV, D]
        sees = torch.ones(t, start + t, dtype=torch.bool, device=qkv.device)
        sees[:, start:] = mask[s].bool() | torch.eye(t, dtype=torch.bool, device=qkv.device)
        for h in range(HQ):
            scores = q[:, h].float() @ keys[:, h // group].T * D ** -0.5  # [T, start + T]
            p = scores.masked_fill(~sees, float("-inf")).softmax(-1)
            out[s * t:(s + 1) * t, h * D:(h + 1) * D] = (p @ values[:, h // group]).to(qkv.dtype)
    return out


def _tree_mask(t: int, gen: torch.Generator) -> torch.Tensor:
    """[T, T]: token i sees its ancestors (a random tree, parents before children) and itself."""
    mask = torch.eye(t, dtype=torch.bool)
    for i in range(1, t):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        mask[i] = mask[parent]
        mask[i, i] = True
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 4, 5, 16])
@pytest.mark.parametrize("grouped", [True, False], ids=["group", "head"])
def test_tree_attention_computes_what_torch_does(dtype: torch.dtype, t: int, grouped: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences at contexts 0, 1, a block, past it and several ranges; their tokens a random tree
    each (T = 1: a batch of decodes), slots not in the rows' order; with four key ranges and
    with one (sms decides), the counters back at zero."""
    from specsplit.models.kernels import verify

    if not grouped:
        monkeypatch.setattr(verify, "query_heads", lambda tokens, heads, kv_heads: 1)
    gen = torch.Generator().manual_seed(t)
    starts = [0, 1, 63, 64, 130, 300, 517]
    b = len(starts)
    qkv = torch.randn(b * t, (HQ + 2 * HKV) * D, generator=gen).to(DEV, dtype)
    angles = torch.arange(1024)[:, None] * torch.linspace(0.01, 1.0, D)[None, :]
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    positions = torch.tensor([s + int(d) for s in starts for d in torch.randint(0, t, (t,), generator=gen)],
                             device=DEV)
    entries = torch.tensor([[s + i for i in range(t)] for s in starts], device=DEV)
    slots = torch.arange(b, 0, -1, device=DEV)
    mask = torch.stack([_tree_mask(t, gen) for _ in starts]).to(DEV)
    k_cache = torch.randn(b + 1, 600, HKV, D, generator=gen).to(DEV, dtype)
    v_cache = torch.randn(b + 1, 600, HKV, D, generator=gen).to(DEV, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = _reference(qkv, cos, sin, positions, starts, slots, mask, k_ref, v_ref)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    counters = torch.zeros(b * HQ, dtype=torch.int32, device=DEV)
    for sms in (1, 1000):  # one key range; four
        k_step, v_step = k_cache.clone(), v_cache.clone()
        got = verify.tree_attention(qkv, cos, sin, positions, entries, slots, mask, k_step, v_step, HQ, HKV,
                                    counters, sms)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        # the rotation's multiply-add may round once on the GPU where torch rounds twice
        close = dict(atol=1e-5, rtol=0.0) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(k_step, k_ref, **close)
        assert torch.equal(v_step, v_ref)
        assert not counters.any()


def test_a_kv_heads_group_shares_a_tile_while_its_rows_fit() -> None:
    from specsplit.models.kernels import verify

    assert verify.query_heads(1, 9, 3) == 3 and verify.query_heads(5, 9, 3) == 3
    assert verify.query_heads(6, 9, 3) == 1  # 18 rows: past the smallest tile
    assert verify.query_heads(4, 32, 8) == 4 and verify.query_heads(5, 32, 8) == 1
    assert verify.query_heads(1, 32, 32) == 1
