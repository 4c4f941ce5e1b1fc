"""The multi-row projections (specsplit.models.kernels.projections) compiled for Hopper without a GPU:
plans that split K inside a program (a batched product a K step) and plans that do not, with K
split across programs or not, compile to tensor-core products. Needs Triton, not a GPU
(tests/test_projections.py runs them)."""

from __future__ import annotations

import pytest

from tests.test_few_compile import needs_compiler

NORM_MM = {"x_ptr": "*bf16", "q_ptr": "*fp32", "Q_TILES": "i32", "w_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32",
           "c_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
           "stride_ym": "i32", "eps": "fp32", "CHUNK": "i32"}
GATE_UP = {k: v for k, v in NORM_MM.items() if k != "stride_ym"}
RESIDUAL = {"x_ptr": "*bf16", "w_ptr": "*bf16", "r_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32", "c_ptr": "*i32",
            "nw_ptr": "*bf16", "xn_ptr": "*bf16", "q_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
            "stride_xm": "i32", "stride_wn": "i32", "CHUNK": "i32"}


def _ptx(kernel: object, signature: dict[str, str], constants: dict[str, object], warps: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(constants, "constexpr")}, constexprs=constants)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3}
                          ).asm["ptx"]


@needs_compiler
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(("block_n", "block_k", "ksplit", "warps"), [(16, 64, 16, 4), (16, 128, 8, 8), (32, 64, 8, 4),
                                                                     (32, 128, 1, 4)])
def test_the_projections_compile_for_hopper(block_n: int, block_k: int, ksplit: int, warps: int, split: bool) -> None:
    from specsplit.models.kernels import projections as proj

    common = {"SPLITS": 2 if split else 1, "SPLIT": split, "USE_PDL": True, "DOT": "tf32", "BLOCK_M": 16,
              "BLOCK_N": block_n, "BLOCK_K": block_k, "KS": ksplit}
    for kernel, signature, extra in [(proj._norm_mm, NORM_MM, {"TILES_P2": 16}),
                                     (proj._gate_up_silu_mm, GATE_UP, {"TILES_P2": 16}),
                                     (proj._mm_residual, RESIDUAL, {"NEXT_NORM": True})]:
        ptx = _ptx(kernel, signature, {**common, **extra}, warps)
        assert "mma.sync" in ptx or "wgmma" in ptx  # on the tensor cores
