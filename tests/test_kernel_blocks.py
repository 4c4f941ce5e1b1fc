"""The decode kernels' block shapes are pinned per GPU model (specsplit.models.kernels.blocks), so
that every process decodes a request to the same tokens: the lookup on the CPU, and on the GPU
two processes decoding the same prompts in bf16."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.tune_gemv import matrices
from specsplit.checkpoints.shapes import SHAPES
from specsplit.models.kernels import blocks
from tests.test_gpu_services import needs_gpus

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_holds_candidates_and_the_lookup_prefers_it() -> None:
    table = blocks.table()
    for gpu, shapes in table.items():
        for key, b in shapes.items():
            kernel, dims = key.split(" ")
            n, k = (int(x) for x in dims.split("x"))
            assert kernel in blocks.KERNELS and b in blocks.CANDIDATES, (gpu, key, b)
            assert blocks.lookup(kernel, n, k, gpu) == b
    assert blocks.lookup("norm_gemv", 960, 576, "a GPU no table knows") == blocks.rule(960, 576)
    with pytest.raises(ValueError, match="unknown GEMV kernel"):
        blocks.lookup("gemm", 960, 576, "NVIDIA H200")


def test_every_decode_matrix_of_the_timed_shapes_is_pinned_on_the_h200() -> None:
    pinned = blocks.table().get("NVIDIA H200", {})
    for shape in ("smollm2-135m", "llama-3.1-8b"):
        for kernel, n, k in matrices(SHAPES[shape]):
            assert blocks.key(kernel, n, k) in pinned, (shape, kernel, n, k)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (49152, 576), (6144, 4096), (4096, 14336), (7, 24)])
def test_the_rule_fixes_the_reduction_order_by_k_alone(n: int, k: int) -> None:
    block_n, block_k, warps = blocks.rule(n, k)
    assert block_k in (256, 512) and warps == 4 and block_n in (1, 2, 4, 8, 16)
    assert blocks.rule(2 * n, k)[1:] == (block_k, warps)  # the order of a row's sum does not depend on N
    assert n // block_n >= 512 or block_n == 1


def test_merged_keeps_other_gpus_and_sorts() -> None:
    assert blocks.merged("NVIDIA H200", {}) == blocks.TABLE_FILE.read_text()  # the file as the tuner writes it
    out = json.loads(blocks.merged("Some GPU", {blocks.key("norm_gemv", 8, 8): (1, 1024, 4)}))
    assert out["Some GPU"] == {"norm_gemv 8x8": [1, 1024, 4]}
    for gpu, shapes in blocks.table().items():
        assert out[gpu] == {k: list(v) for k, v in shapes.items()}
    assert list(out) == sorted(out)


def test_multi_row_plans_are_candidates_pinned_per_rows_bucket() -> None:
    for gpu, shapes in blocks.mm_table().items():
        for key, entry in shapes.items():
            kernel, dims, bucket = key.split(" ")
            n, k = (int(x) for x in dims.split("x"))
            plan = blocks.Plan.of(k, *entry)
            assert kernel in blocks.MM_KERNELS and bucket == "m16", (gpu, key)  # the projections' tiles of 16 rows
            assert plan in blocks.mm_candidates(k) and plan.pinned() == list(entry), (gpu, key, entry)
            assert blocks.mm_lookup(kernel, n, k, int(bucket[1:]), gpu, 132) == plan
            # fp32 steps take the rule: the table's tiles are measured in 2-byte dtypes
            assert blocks.mm_lookup(kernel, n, k, int(bucket[1:]), gpu, 132, pinned=False) == blocks.mm_rule(n, k, 132)
    assert blocks.mm_lookup("norm_mm", 960, 576, 16, "a GPU no table knows", 132) == blocks.mm_rule(960, 576, 132)
    with pytest.raises(ValueError, match="unknown multi-row kernel"):
        blocks.mm_lookup("norm_gemv", 960, 576, 16, "NVIDIA H200", 132)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (49152, 576), (6144, 4096), (4096, 14336)])
def test_a_plan_covers_k_in_whole_steps(n: int, k: int) -> None:
    for plan in [*blocks.mm_candidates(k), blocks.mm_rule(n, k, 132)]:
        assert plan.chunk % plan.step == 0 and plan.splits * plan.chunk >= k > (plan.splits - 1) * plan.chunk
        assert plan.split == (plan.splits > 1)
        assert plan.step == plan.block_k * plan.ksplit
    assert blocks.mm_rule(960, 576, 132).splits * 30 >= 132  # narrow projections split K to fill the GPU
    assert blocks.Plan.of(576, 16, 256, 576) == blocks.Plan(16, 256, 1, 768)  # one chunk: all of K


def test_plans_that_split_k_inside_a_program() -> None:
    """K steps of ksplit tiles: chunks round up to whole steps, and the table entry carries ksplit
    only where it is not 1 (the entries pinned before it read as before)."""
    plan = blocks.Plan.of(576, 16, 64, 576, 4, 16)
    assert plan == blocks.Plan(16, 64, 1, 1024, 4, 16) and plan.step == 1024
    assert blocks.Plan.of(576, 16, 128, 512, 4, 4) == blocks.Plan(16, 128, 2, 512, 4, 4)  # and K over 2 programs
    assert plan.pinned() == [16, 64, 1024, 4, 16] and blocks.Plan.of(576, *plan.pinned()) == plan
    assert blocks.Plan.of(576, 32, 64, 64).pinned() == [32, 64, 64, 4]
    for k in (576, 1536, 4096):
        ways = blocks.ksplit_candidates(k)
        assert ways and set(ways) <= set(blocks.mm_candidates(k))
        for p in ways:  # each warp has tiles of its own; tiles and steps are powers of two
            assert p.ksplit >= p.warps and p.ksplit & (p.ksplit - 1) == 0 and p.step & (p.step - 1) == 0


def decode_prompts(out: str) -> None:
    """Target-only greedy decoding in this process: SmolLM2's shape with random bf16 weights, the
    fused step with PDL, 8 prompts × 256 tokens one at a time; the tokens written to `out`."""
    import torch

    from gateway.local import LocalEngines
    from gateway.sequence import GenerationRequest
    from specsplit.ops import Sampling
    from target_service.config import TargetConfig

    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(16, 96, (8,), generator=g).tolist()
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]
    e = LocalEngines(TargetConfig(model="shape:smollm2-135m", device="cuda", dtype="bfloat16", max_context=512,
                                  fused_decode="pdl"), None)
    try:
        tokens = [e.generate([GenerationRequest(p, 256, Sampling(), set(), 0)])[0].tokens for p in prompts]
    finally:
        e.close()
    Path(out).write_text(json.dumps(tokens))


@pytest.mark.gpu
@needs_gpus(1)
def test_two_processes_decode_the_same_tokens_in_bf16(tmp_path: Path) -> None:
    """Each process compiles its own kernels: with the block shapes pinned, 8 prompts × 256
    tokens decode to the same tokens in both."""
    outs = [tmp_path / f"tokens{i}.json" for i in range(2)]
    for out in outs:
        subprocess.run([sys.executable, "-c", f"from tests.test_kernel_blocks import decode_prompts; "
                        f"decode_prompts({str(out)!r})"], cwd=ROOT, check=True, timeout=540)
    first, second = (json.loads(out.read_text()) for out in outs)
    assert [len(t) for t in first] == [256] * 8
    assert first == second
