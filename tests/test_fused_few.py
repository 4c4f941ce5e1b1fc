"""The few-row kernels (specsplit.models.kernels.few): each projection against torch, a row's bits
whatever the rows beside it and equal to the decode's, each row's attention the decode's at its
position, a chain verified or a batch decoded on the few-row path giving the one-token decodes'
logits bit for bit, and the few-row step against the tensor-core step. On a GPU; on the CPU
under the Triton interpreter too (TRITON_INTERPRET=1, float32 only)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from specsplit.checkpoints.shapes import SHAPES
from specsplit.models.batch import Batch, tree_layout
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import TensorParallel

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEV == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.quick, *([] if INTERPRETED else [pytest.mark.gpu])]
needs_kernels = pytest.mark.skipif(DEV == "cpu" and not INTERPRETED, reason="needs a GPU or TRITON_INTERPRET=1")
DTYPES = [torch.float32] if INTERPRETED else [torch.float32, torch.bfloat16]


def _rand(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("nk", [(96, 80), (200, 576), (40, 1536)])
def test_each_projection_computes_what_torch_does(dtype: torch.dtype, rows: int, nk: tuple[int, int]) -> None:
    from specsplit.models.kernels import few

    torch.manual_seed(0)
    n, k = nk
    x, nw = _rand(rows, k, dtype=dtype), _rand(k, dtype=dtype).abs() + 0.5
    w, w2, res = _rand(n, k, dtype=dtype, scale=0.05), _rand(2 * n, k, dtype=dtype, scale=0.05), _rand(rows, n,
                                                                                                     dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    normed = _rms(x, nw, 1e-5)

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.shape == want.shape
        assert (got.float() - want).abs().max().item() <= tol * max(want.abs().max().item(), 1.0)

    close(few.norm_gemv(x, w, nw, 1e-5), normed @ w.float().T)
    close(few.norm_gemv(x, w, None, 1e-5, out_dtype=torch.float32), x.float() @ w.float().T)
    g, u = normed @ w2[:n].float().T, normed @ w2[n:].float().T
    close(few.gate_up_silu(x, w2, nw, 1e-5), torch.nn.functional.silu(g) * u)
    close(few.gemv_residual(x, w, res), res.float() + x.float() @ w.float().T)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_computes_the_same_bits_whatever_rows_are_beside_it(dtype: torch.dtype) -> None:
    from specsplit.models.kernels import few

    torch.manual_seed(1)
    n, k = 960, 576
    x, nw, w = _rand(8, k, dtype=dtype), _rand(k, dtype=dtype).abs() + 0.5, _rand(n, k, dtype=dtype, scale=0.05)
    res = _rand(8, n, dtype=dtype)
    for m in (1, 2, 3, 4, 7, 8):
        assert torch.equal(few.norm_gemv(x[:m], w, nw, 1e-5), few.norm_gemv(x, w, nw, 1e-5)[:m])
        assert torch.equal(few.gemv_residual(x[:m], w, res[:m]), few.gemv_residual(x, w, res)[:m])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_computes_the_decodes_bits(dtype: torch.dtype) -> None:
    """The decode's GEMVs, row by row, with its blocks: where they cover K, where they take a few
    steps over K (unrolled: the down projection, the lm_head) and where they loop over K (more
    than kernels.decode.UNROLLED_STEPS steps)."""
    from specsplit.models.kernels import decode, few

    torch.manual_seed(2)
    cfg = SHAPES["smollm2-135m"]
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = ((("norm_gemv", 24, 576), ("norm_gemv", 20, 300), ("gemv_residual", 16, 600), ("gate_up_silu", 12, 576),
               ("norm_gemv", 20, 1000), ("gate_up_silu", 12, 1000))
              if INTERPRETED else  # (K past the interpreter's blocks of 256; 1000: 4 steps, a loop)
              (("norm_gemv", 960, h), ("norm_gemv", 2000, h), ("norm_gemv", cfg.vocab_size, h),
               ("gemv_residual", h, h), ("gemv_residual", h, inter), ("gate_up_silu", inter, h),
               ("gemv_residual", h, 4096), ("norm_gemv", 960, 4096)))  # (4096: the rule's 8 steps, a loop)
    for name, n, k in shapes:
        x, nw = _rand(6, k, dtype=dtype), _rand(k, dtype=dtype).abs() + 0.5
        w = _rand(2 * n if name == "gate_up_silu" else n, k, dtype=dtype, scale=0.05)
        res = _rand(6, n, dtype=dtype)
        if name == "norm_gemv":
            want = [decode.norm_gemv(x[r], w, nw, 1e-5) for r in range(6)]
            want32 = [decode.norm_gemv(x[r], w, None, 1e-5, out_dtype=torch.float32) for r in range(6)]
        elif name == "gate_up_silu":
            want = [decode.gate_up_silu(x[r], w, nw, 1e-5) for r in range(6)]
        else:
            want = [decode.gemv_residual(x[r], w, res[r]) for r in range(6)]
        for m in (3, 4, 6):
            if name == "norm_gemv":
                got = few.norm_gemv(x[:m], w, nw, 1e-5)
                got32 = few.norm_gemv(x[:m], w, None, 1e-5, out_dtype=torch.float32)
                assert all(torch.equal(got32[r], want32[r]) for r in range(m))
            elif name == "gate_up_silu":
                got = few.gate_up_silu(x[:m], w, nw, 1e-5)
            else:
                got = few.gemv_residual(x[:m], w, res[:m])
            assert all(torch.equal(got[r], want[r]) for r in range(m)), (name, n, k, m)


def _depths(parents: list[int]) -> list[int]:
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def _path(parents: list[int], i: int) -> list[int]:
    """Row i's ancestors, root first, then i."""
    path = [i]
    while parents[path[0]] >= 0:
        path.insert(0, parents[path[0]])
    return path


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start,split", [(40, False), (126, False), (126, True), (510, True), (1020, True)])
@pytest.mark.parametrize("parents", [[-1, 0, 1, 2], [-1, 0, 0, 1, 2, 1]], ids=["chain4", "tree6"])
def test_each_row_attends_as_the_decode_at_its_position(dtype: torch.dtype, start: int, split: bool,
                                                        parents: list[int]) -> None:
    """Row i of a step (a chain, a tree) against one-token decodes down its path on a copy of the
    cache: the same output bits, the same KV entry (at the decode's position); from 126
    committed entries the path crosses a block of keys; with counters (`split`) both split their
    keys in ranges: from 510 (4 blocks, then 5) in two, near 1,024 in four (8 blocks)."""
    from specsplit.models.kernels import decode, few

    torch.manual_seed(3)
    hq, hkv, d, t = 9, 3, 64, len(parents)
    qkv = _rand(t, (hq + 2 * hkv) * d, dtype=dtype)
    angles = torch.arange(2048, device=DEV)[:, None] * torch.linspace(0.01, 1.0, d, device=DEV)[None, :]
    cos, sin = angles.cos(), angles.sin()
    k_cache, v_cache = _rand(2, 1040, hkv, d, dtype=dtype), _rand(2, 1040, hkv, d, dtype=dtype)
    counters = torch.zeros(t * hq, dtype=torch.int32, device=DEV) if split else None
    depth = _depths(parents)
    positions = torch.tensor([start + x for x in depth], device=DEV)
    entries = torch.arange(start, start + t, device=DEV).view(1, t)
    mask = torch.zeros(1, t, t, dtype=torch.bool, device=DEV)
    for i in range(t):
        mask[0, i, _path(parents, i)] = True
    slots = torch.ones(1, dtype=torch.long, device=DEV)
    k_few, v_few = k_cache.clone(), v_cache.clone()
    out = few.row_attention(qkv, cos, sin, positions, entries, slots, mask, k_few, v_few, hq, hkv, counters=counters)
    for i in range(t):
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        for j in _path(parents, i):
            pos = torch.tensor([start + depth[j]], device=DEV)
            want = decode.rope_attention(qkv[j], cos, sin, pos, slots, k_ref, v_ref, hq, hkv, counters=counters)
        assert torch.equal(out[i], want)
        if split:  # the ranges combined: the one-program walk's result up to rounding; the counters back at zero
            whole = decode.rope_attention(qkv[j], cos, sin, pos, slots, k_ref.clone(), v_ref.clone(), hq, hkv)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert torch.allclose(want.float(), whole.float(), atol=tol, rtol=tol)
            assert not counters.any()
        assert torch.equal(k_few[1, start + i], k_ref[1, start + depth[i]])
        assert torch.equal(v_few[1, start + i], v_ref[1, start + depth[i]])
    assert torch.equal(k_few[:, :start], k_cache[:, :start])


def _model(cfg: object, dtype: torch.dtype) -> LlamaModel:
    torch.manual_seed(0)
    with torch.device(DEV):
        model = LlamaModel(cfg, TensorParallel(), [0, 1]).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model.to(dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parents", [[-1, 0], [-1, 0, 1, 2], [-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4, 5, 6]],
                         ids=["chain2", "chain4", "tree6", "chain8"])
def test_few_rows_step_matches_the_tensor_core_step(dtype: torch.dtype, parents: list[int]) -> None:
    """A verify of 2 to 8 tokens through the few-row path and through the multi-row projections
    (few_rows=0), each on a cache of its own after the same prompt: logits, features, KV entries."""
    from specsplit.models.fused import FusedLlama

    shape = (dict(num_layers=2, hidden_size=96, intermediate_size=192, head_dim=32, vocab_size=500)
             if INTERPRETED else dict(num_layers=2, vocab_size=4096))
    cfg = dataclasses.replace(SHAPES["smollm2-135m"], **shape)
    model = _model(cfg, dtype)
    start, t = 40, len(parents)
    prompt = torch.randint(0, cfg.vocab_size, (start,), device=DEV)
    tokens = torch.randint(0, cfg.vocab_size, (t,), device=DEV)
    positions, rows, cols = tree_layout(start, parents)
    pos = torch.tensor([positions], device=DEV)
    entries = torch.arange(start, start + t, device=DEV).view(1, t)
    visible = torch.zeros(1, t, 64, dtype=torch.bool, device=DEV)
    visible[0, rows, cols] = True
    mask = visible[:, :, start : start + t].contiguous()
    slots = torch.ones(1, dtype=torch.long, device=DEV)
    outs = []
    for few_rows in (8, 0):
        fused = FusedLlama(model, few_rows=few_rows)
        assert fused.few_rows == few_rows
        cache = model.new_cache(2, 64)
        with torch.inference_mode():
            model(prompt, Batch.sequence(prompt, slot=1), cache)
            logits, aux = fused.forward(tokens, Batch.padded(pos, slots, entries, 0, mask, capture=True), cache)
        outs.append((logits, aux, cache.k[:, 1, : start + t].float(), cache.v[:, 1, : start + t].float()))
    tol = 1e-4 if dtype == torch.float32 else 4e-2
    for got, want in zip(outs[0], outs[1], strict=True):
        assert got is not None and want is not None and got.shape == want.shape
        assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()
    if dtype == torch.float32:
        assert torch.equal(outs[0][0].argmax(-1), outs[1][0].argmax(-1))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_chain_and_a_batch_on_the_few_row_path_give_the_decodes_logits(dtype: torch.dtype) -> None:
    """A chain of 4 tokens verified in one few-row step, and 3 sequences decoding side by side,
    against one-token fused decodes on caches of their own: logits, features and KV entries bit
    for bit (bf16 too)."""
    from specsplit.models.fused import FusedLlama

    shape = (dict(num_layers=2, hidden_size=96, intermediate_size=192, head_dim=32, vocab_size=500)
             if INTERPRETED else dict(num_layers=2, vocab_size=4096))
    cfg = dataclasses.replace(SHAPES["smollm2-135m"], **shape)
    model = _model(cfg, dtype)
    fused = FusedLlama(model, few_rows=4)
    starts = [40, 131, 7]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), device=DEV) for n in starts]
    tokens = torch.randint(0, cfg.vocab_size, (4,), device=DEV)

    def prefilled() -> object:
        cache = model.new_cache(4, 192)
        for slot, prompt in enumerate(prompts):
            model(prompt, Batch.sequence(prompt, slot=slot), cache)
        return cache

    def decode(cache: object, slot: int, token: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        one = torch.tensor([[at]], device=DEV)
        batch = Batch.padded(one, torch.tensor([slot], device=DEV), one, 0, capture=True)
        logits, aux = fused.forward(token.view(1), batch, cache)
        assert aux is not None
        return logits, aux

    with torch.inference_mode():
        ref = prefilled()
        want = [decode(ref, 0, tokens[i], 40 + i) for i in range(4)]
        cache = prefilled()
        pos = torch.arange(40, 44, device=DEV).view(1, 4)
        logits, aux = fused.forward(tokens, Batch.padded(pos, torch.zeros(1, dtype=torch.long, device=DEV), pos, 0,
                                                         capture=True), cache)
        assert aux is not None
        for i in range(4):
            assert torch.equal(logits[i], want[i][0][0]) and torch.equal(aux[i], want[i][1][0])
        assert torch.equal(cache.k[:, 0, :44], ref.k[:, 0, :44]) and torch.equal(cache.v[:, 0, :44], ref.v[:, 0, :44])

        last = torch.stack([p[-1] for p in prompts])
        ref = prefilled()
        want = [decode(ref, b, last[b], starts[b]) for b in range(3)]
        cache = prefilled()
        pos = torch.tensor(starts, device=DEV).view(3, 1)
        logits, aux = fused.forward(last, Batch.padded(pos, torch.arange(3, device=DEV), pos, 0, capture=True), cache)
        assert aux is not None
        for b in range(3):
            assert torch.equal(logits[b], want[b][0][0]) and torch.equal(aux[b], want[b][1][0])
            assert torch.equal(cache.k[:, b, : starts[b] + 1], ref.k[:, b, : starts[b] + 1])


@needs_kernels
def test_the_few_row_path_serves_small_models_by_default() -> None:
    from specsplit.models.fused import FEW_ROWS_BY_GPU, FEW_ROWS_DEFAULT, FEW_ROWS_HIDDEN, FEW_ROWS_MAX, FusedLlama
    from specsplit.models.kernels import few

    small = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=2, hidden_size=96, intermediate_size=192,
                                head_dim=32, vocab_size=500)
    wide = dataclasses.replace(small, hidden_size=FEW_ROWS_HIDDEN + 64, num_heads=FEW_ROWS_HIDDEN // 64 + 1,
                               head_dim=64)
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else ""
    assert FusedLlama(_model(small, torch.float32)).few_rows == FEW_ROWS_BY_GPU.get(gpu, FEW_ROWS_DEFAULT)
    assert FusedLlama(_model(wide, torch.float32)).few_rows == 0
    assert FusedLlama(_model(wide, torch.float32), few_rows=2).few_rows == 2
    assert FusedLlama(_model(small, torch.float32), few_rows=64).few_rows == FEW_ROWS_MAX
    with pytest.raises(ValueError, match="few-row kernels take"):
        few.norm_gemv(torch.zeros(FEW_ROWS_MAX + 1, 96, device=DEV), torch.zeros(8, 96, device=DEV), None, 1e-5)

