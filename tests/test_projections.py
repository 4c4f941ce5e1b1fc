"""The fused verify's split-K projections (specsplit.models.kernels.projections) against torch in fp32
and bf16: rms_norm(x)·Wᵀ, the residual add that also hands the next norm its input, and gate|up with
SiLU·mul; a row's bits do not depend on how many rows the step has (tiles of 16 rows side by side);
the counters end at zero."""

from __future__ import annotations

import pytest
import torch

from tests.test_gpu_services import needs_gpus

SHAPES = {"narrow": (960, 576), "deep-k": (576, 1536), "wide": (1536, 576)}  # (N, K), SmolLM2's projections
ROWS = (1, 2, 5, 16, 17, 64, 65, 130, 256)
DEV = "cuda"


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


@pytest.mark.gpu
@needs_gpus(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("plans", "shape"), [  # the quick subset: the pinned plans of the deep K
    pytest.param(p, s, marks=pytest.mark.quick if (p, s) == ("pinned", "deep-k") else ())
    for p in ("pinned", "split", "whole", "ksplit", "ksplit-split") for s in SHAPES])
def test_projections_match_torch_and_rows_keep_their_bits(dtype: torch.dtype, shape: str, plans: str) -> None:
    """The pinned plans (kernels.blocks), the rule's split-K plans, one program a tile over all of K,
    and K split inside a program (steps of 8 tiles of 64 columns, in fp32 4 of 32; with K also split
    across programs)."""
    from specsplit.models.kernels import blocks
    from specsplit.models.kernels import projections as proj

    n, k = SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(0)

    def rand(*size: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*size, device=DEV, generator=g) * scale + shift).to(dtype)

    w, gate_up = rand(n, k, scale=0.05), rand(2 * n, k, scale=0.05)
    norm_in, norm_next = rand(k, scale=0.1, shift=1.0), rand(n, scale=0.1, shift=1.0)
    xs, residual = rand(ROWS[-1], k), rand(ROWS[-1], n)
    ws = proj.Workspace(DEV)
    if plans == "split":
        assert blocks.mm_rule(n, k, ws.sms).split  # these shapes split K
        ws.plan = lambda kernel, n, k, rows, dtype: blocks.mm_rule(n, k, ws.sms)  # type: ignore[method-assign]
    elif plans == "whole":
        ws.plan = lambda kernel, n, k, rows, dtype: blocks.Plan.of(k, 16, 64, k)  # type: ignore[method-assign]
    elif plans.startswith("ksplit"):  # fp32 tiles take twice the shared memory: narrower K steps
        chunk = 512 if plans == "ksplit-split" else k
        block_k, ways = (64, 8) if dtype == torch.bfloat16 else (32, 4)
        ws.plan = lambda kernel, n, k, rows, dtype: blocks.Plan.of(k, 16, block_k, chunk, 4, ways)  # type: ignore[method-assign]
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    largest: dict[str, torch.Tensor] = {}  # the largest step's outputs
    for m in sorted(ROWS, reverse=True):
        x = xs[:m]
        xn = (_rms(x.float()).to(dtype) * norm_in).float()
        _, normed = proj.embed_prenorm(torch.arange(m, device=DEV), x, norm_in)
        h, after = proj.mm_residual(x, w, residual[:m], ws=ws, next_norm=norm_next)
        assert after is not None
        got = {"norm_mm": proj.norm_mm(normed, w, 1e-5, ws=ws),
               "mm_residual": h,
               "gate_up_silu": proj.gate_up_silu(normed, gate_up, 1e-5, ws=ws),
               "next_norm": proj.norm_mm(after, torch.eye(n, device=DEV, dtype=dtype), 1e-5, ws=ws)}
        want = {"norm_mm": xn @ w.float().t(),
                "mm_residual": residual[:m].float() + x.float() @ w.float().t(),
                "gate_up_silu": torch.nn.functional.silu(xn @ gate_up[:n].float().t()) * (xn @ gate_up[n:].float().t()),
                "next_norm": _rms(h.float()) * norm_next.float()}
        for name, value in got.items():
            err = (value.float() - want[name]).abs().max() / want[name].abs().max()
            assert err.item() <= tol, (name, m, err.item())
            largest.setdefault(name, value.clone())
            assert torch.equal(value, largest[name][:m]), (name, m)  # each row's bits, whatever the step's rows
        assert not ws.counters.any()  # every tile's last program reset its counter
