"""The one-row Triton GEMV (specsplit.ops_triton) and the switch that routes projections to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specsplit.models import parallel
from specsplit.models.parallel import linear, use_one_row_gemv


def test_switch_is_a_no_op_off_cuda() -> None:
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    use_one_row_gemv(True)
    try:
        assert torch.equal(linear(x, w), F.linear(x, w))
    finally:
        use_one_row_gemv(False)
    assert parallel._ONE_ROW_GEMV is False


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(576, 576), (1000, 1536), (4096, 4096), (49152, 576)])
def test_gemv_matches_linear(dtype: torch.dtype, n: int, k: int) -> None:
    from specsplit.ops_triton import gemv

    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(1, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) * 0.02
    ref = x.double() @ w.double().T
    got = gemv(x, w)
    assert got.shape == (1, n) and got.dtype == dtype
    scale = ref.abs().max().item()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert (got.double() - ref).abs().max().item() <= tol * scale
    use_one_row_gemv(True)
    try:
        assert torch.equal(linear(x, w), got)  # one row on CUDA: routed to the GEMV
        assert torch.equal(linear(x.expand(2, k), w), F.linear(x.expand(2, k), w))  # two rows: cuBLAS
    finally:
        use_one_row_gemv(False)


@pytest.mark.gpu
def test_gemv_rejects_more_than_one_row() -> None:
    from specsplit.ops_triton import gemv

    with pytest.raises(ValueError, match="one row|gemv takes"):
        gemv(torch.zeros(2, 8, device="cuda"), torch.zeros(4, 8, device="cuda"))
