"""The verify's acceptance kernel (specsplit.models.kernels.accept) compiled for Hopper without a
GPU (tests/test_accept_kernel.py runs it)."""

from __future__ import annotations

import pytest

from specsplit.runner.acceptance import ALWAYS
from tests.test_few_compile import needs_compiler


@needs_compiler
@pytest.mark.parametrize("tree", [False, True])
def test_the_kernel_compiles_for_hopper(tree: bool) -> None:
    """The interpreter runs what the compiler refuses (a global that is not a constexpr): compiled
    for sm_90 as a launch does, without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specsplit.models.kernels import accept as kernel

    signature = dict.fromkeys(kernel._accept_rows.arg_names, "i32")
    signature.update(dict.fromkeys(["best_ptr", "fields_ptr", "anc_ptr", "starts_ptr", "slots_ptr", "readback_ptr"],
                                   "*i64"))
    signature.update(dict.fromkeys(["k_ptr", "v_ptr", "feat_ptr", "out_feat_ptr"], "*bf16"))
    constants = {"CHAIN": not tree, "ALWAYS": ALWAYS, "TREE": tree, "FEATURES": True, "W": 192, "BLOCK_T": 16,
                 "BLOCK_X": 128, "BLOCK_W": 256}
    signature.update(dict.fromkeys(constants, "constexpr"))
    compiled = triton.compile(ASTSource(kernel._accept_rows, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    assert compiled.asm["ptx"]
