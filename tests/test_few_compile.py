"""The few-row GEMVs (specsplit.models.kernels.few) compiled for Hopper without a GPU: each runs the
decode's float instructions in the decode's order, so its rows compute the decode's bits (the
GPU tests in tests/test_fused_few.py check the bits themselves). Needs Triton, not a GPU."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

# Triton's compiler, not its interpreter (TRITON_INTERPRET=1 turns the kernels into Python)
needs_compiler = pytest.mark.skipif(importlib.util.find_spec("triton") is None
                                    or os.environ.get("TRITON_INTERPRET") == "1",
                                    reason="needs Triton's compiler (no GPU), not its interpreter")


def _float_ops(kernel: object, signature: dict[str, str], constants: dict[str, object], warps: int) -> list[str]:
    """The float instructions, in order, of a kernel compiled for Hopper (sm_90) without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    options = {"num_warps": warps, "num_stages": 3}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    float_op = re.compile(r"\s*(fma|add|sub|mul|div|ex2|rcp|rsqrt|max|cvt)\.")
    ops = [line.split()[0] for line in ptx.splitlines() if float_op.match(line)]
    return [op for op in ops if ".f32" in op or ".bf16" in op or op.startswith(("ex2", "rcp", "rsqrt"))]


@needs_compiler
def test_the_few_row_gemvs_compile_to_the_decodes_float_instructions() -> None:
    """Each few-row GEMV, compiled for sm_90, runs the decode's float instructions in the decode's
    order (where the decode's tile covers K, where it takes a few unrolled steps over K, and where
    it loops over K: 1536 in steps of 256): only addressing differs."""
    from specsplit.models.kernels import decode, few

    ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "stride_wn": "i32"}
    for block_k in (1024, 256):
        sig = {**ptrs, "nw_ptr": "*bf16", "eps": "fp32", "K_SUM": "i32"}
        consts = {"K": 576, "HAS_NORM": True, "USE_PDL": True, "BLOCK_N": 8, "BLOCK_K": block_k}
        sig_c = {**sig, **dict.fromkeys(consts, "constexpr")}
        want = _float_ops(decode._norm_gemv, sig_c, consts, 8)
        got = _float_ops(few._few_norm_gemv, {**sig_c, "stride_xm": "i32", "stride_ym": "i32"}, consts, 8)
        assert want and got == want
        consts = {"K": 576, "USE_PDL": True, "BLOCK_N": 4, "BLOCK_K": block_k}
        sig_c = {**sig, **dict.fromkeys(consts, "constexpr")}
        want = _float_ops(decode._gate_up_silu, sig_c, consts, 4)
        assert want and _float_ops(few._few_gate_up_silu, {**sig_c, "stride_xm": "i32"}, consts, 4) == want
        consts = {"K": 1536, "USE_PDL": True, "BLOCK_N": 1, "BLOCK_K": block_k}
        sig_c = {**ptrs, "r_ptr": "*bf16", **dict.fromkeys(consts, "constexpr")}
        want = _float_ops(decode._gemv_residual, sig_c, consts, 8)
        sig_f = {**ptrs, "res_ptr": "*bf16", "stride_xm": "i32", **dict.fromkeys(consts, "constexpr")}
        assert want and _float_ops(few._few_gemv_residual, sig_f, consts, 8) == want


@needs_compiler
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("splits", [1, 8])
def test_row_attention_compiles_for_hopper(pdl: bool, splits: int) -> None:
    """The rows' attention (its branches on the rows each row sees) compiles for sm_90, with and
    without programmatic dependent launch, in one range of keys or in ranges, and keeps the
    decode attention's softmax."""
    from specsplit.models.kernels import decode, few

    ptrs = {"qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64",
            "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "c_ptr": "*i32",
            "stride_slot": "i32", "stride_pos": "i32", "scale": "fp32"}
    consts = {"HQ": 9, "HKV": 3, "D": 64, "USE_PDL": pdl, "BLOCK_S": 128, "SPLITS": splits}
    rows = _float_ops(few._row_attention, {**ptrs, "stride_qkv": "i32", "entry_ptr": "*i64", "mask_ptr": "*u8",
                                           "T": "i32", **dict.fromkeys([*consts, "TP"], "constexpr")},
                      {**consts, "TP": 4}, 8)
    one = _float_ops(decode._rope_attention, {**ptrs, **dict.fromkeys(consts, "constexpr")}, consts, 8)
    assert one and rows.count("ex2.approx.f32") == one.count("ex2.approx.f32")
