"""The multi-row projections (specsplit.models.kernels.projections) compiled for Hopper without a GPU:
plans that split K inside a program (a batched product a K step) and plans that do not, with K
split across programs or not, compile to tensor-core products; a plan whose chunk of K is one
step compiles without the K loop's pipeline buffers. Needs Triton, not a GPU
(tests/test_projections.py runs them)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_few_compile import needs_compiler

NORM_MM = {"x_ptr": "*bf16", "q_ptr": "*fp32", "Q_TILES": "i32", "Q_STRIDE": "i32", "w_ptr": "*bf16",
           "y_ptr": "*bf16", "p_ptr": "*fp32", "c_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "eps": "fp32"}
GATE_UP = {k: v for k, v in NORM_MM.items() if k != "stride_ym"}
RESIDUAL = {"x_ptr": "*bf16", "w_ptr": "*bf16", "r_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32", "c_ptr": "*i32",
            "nw_ptr": "*bf16", "xn_ptr": "*bf16", "q_ptr": "*fp32", "Q_STRIDE": "i32", "M": "i32", "N": "i32",
            "K": "i32", "stride_xm": "i32", "stride_wn": "i32"}


def _compiled(kernel: Any, signature: dict[str, str], constants: dict[str, object], warps: int) -> Any:
    """As a launch compiles it: pointers, strides and sizes divisible by 16 (not the rows' count nor the
    norm's tile count)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in signature if a not in ("M", "eps", "Q_TILES")}
    src = ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(constants, "constexpr")}, constexprs=constants,
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3})


def _kernels() -> list[tuple[Any, dict[str, str], dict[str, object]]]:
    from specsplit.models.kernels import projections as proj

    return [(proj._norm_mm, NORM_MM, {"TILES_P2": 16}), (proj._gate_up_silu_mm, GATE_UP, {"TILES_P2": 16}),
            (proj._mm_residual, RESIDUAL, {"NEXT_NORM": True})]


@needs_compiler
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(("block_n", "block_k", "ksplit", "warps"), [(16, 64, 16, 4), (16, 128, 8, 8), (32, 64, 8, 4),
                                                                     (32, 128, 1, 4)])
def test_the_projections_compile_for_hopper(block_n: int, block_k: int, ksplit: int, warps: int, split: bool) -> None:
    common = {"SPLITS": 2 if split else 1, "SPLIT": split, "USE_PDL": True, "DOT": "tf32", "BLOCK_M": 16,
              "BLOCK_N": block_n, "BLOCK_K": block_k, "KS": ksplit, "CHUNK": 2 * block_k * ksplit}
    for kernel, signature, extra in _kernels():
        ptx = _compiled(kernel, signature, {**common, **extra}, warps).asm["ptx"]
        assert "mma.sync" in ptx or "wgmma" in ptx  # on the tensor cores


@needs_compiler
@pytest.mark.parametrize(("block_n", "block_k", "ksplit"), [(16, 64, 16), (16, 128, 8), (16, 256, 4)])
def test_a_chunk_of_one_step_takes_no_pipeline_buffers(block_n: int, block_k: int, ksplit: int) -> None:
    """A program's whole chunk in one K step (the pinned plans that split K inside a program): its
    shared memory holds one step's operands, not the num_stages buffers of a loop that never runs
    (a loop's buffers: 130 KB a program for the H100's o plan)."""
    step = block_k * ksplit
    common = {"SPLITS": 1, "SPLIT": False, "USE_PDL": True, "DOT": "tf32", "BLOCK_M": 16, "BLOCK_N": block_n,
              "BLOCK_K": block_k, "KS": ksplit}
    for kernel, signature, extra in _kernels():
        one = _compiled(kernel, signature, {**common, **extra, "CHUNK": step}, 4)
        two = _compiled(kernel, signature, {**common, **extra, "CHUNK": 2 * step}, 4)
        assert one.metadata.shared < two.metadata.shared
        assert one.metadata.shared <= 48 * 1024, (kernel.fn.__name__, one.metadata.shared)
