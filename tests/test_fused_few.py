"""The few-row kernels (specsplit.models.kernels.few): each projection against torch, a row's bits
whatever the rows beside it, the decode's bits where the decode's blocks cover K, and the fused
step of a few rows (FusedLlama's few-row path) against its tensor-core path. On a GPU; on the CPU
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


@pytest.mark.skipif(DEV != "cuda", reason="the decode's pinned blocks are a GPU's")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_compute_the_decodes_bits_where_its_blocks_cover_k(dtype: torch.dtype) -> None:
    from specsplit.models.kernels import blocks, decode, few

    torch.manual_seed(2)
    gpu = torch.cuda.get_device_name()
    cfg = SHAPES["smollm2-135m"]
    checked = 0
    for name, n, k in (("norm_gemv", 960, cfg.hidden_size), ("gemv_residual", 576, 576),
                       ("gate_up_silu", cfg.intermediate_size, cfg.hidden_size)):
        if blocks.lookup(name, n, k, gpu)[1] < k:
            continue
        checked += 1
        x, nw = _rand(4, k, dtype=dtype), _rand(k, dtype=dtype).abs() + 0.5
        w = _rand(2 * n if name == "gate_up_silu" else n, k, dtype=dtype, scale=0.05)
        res = _rand(4, n, dtype=dtype)
        for r in range(4):
            if name == "norm_gemv":
                assert torch.equal(few.norm_gemv(x, w, nw, 1e-5)[r], decode.norm_gemv(x[r], w, nw, 1e-5))
            elif name == "gate_up_silu":
                assert torch.equal(few.gate_up_silu(x, w, nw, 1e-5)[r], decode.gate_up_silu(x[r], w, nw, 1e-5))
            else:
                assert torch.equal(few.gemv_residual(x, w, res)[r], decode.gemv_residual(x[r], w, res[r]))
    if not checked:
        pytest.skip(f"no decode block of {gpu} covers its K")


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
def test_the_few_row_path_serves_small_models_only() -> None:
    from specsplit.models.fused import FusedLlama
    from specsplit.models.kernels import few

    small = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=2, hidden_size=96, intermediate_size=192,
                                head_dim=32, vocab_size=500)
    wide = dataclasses.replace(small, intermediate_size=2 * few.WHOLE_K)
    assert FusedLlama(_model(small, torch.float32), few_rows=few.FEW_ROWS).few_rows == few.FEW_ROWS
    assert FusedLlama(_model(wide, torch.float32), few_rows=few.FEW_ROWS).few_rows == 0
    with pytest.raises(ValueError, match="few-row kernels take"):
        few.norm_gemv(torch.zeros(few.FEW_ROWS + 1, 96, device=DEV), torch.zeros(8, 96, device=DEV), None, 1e-5)
