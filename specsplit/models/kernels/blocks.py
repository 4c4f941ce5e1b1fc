"""Block shapes of the fused step's kernels, pinned per GPU model: the one-token GEMVs
(kernels.decode, `gemv_blocks.json`) and the multi-row projections (kernels.projections,
`mm_plans.json`).

A kernel's block shape sets its reduction order along K (BLOCK_K, split-K chunks, the warps a
tile is split over), so in bf16 two processes that picked different shapes round some logits
apart and can decode different tokens. The shapes are therefore never tuned at run time: they
come from the tables, measured once per GPU model (`python -m bench.tune_gemv --write`,
`python -m bench.tune_mm --write`), or, for a GPU model or a matrix a table lacks, from a fixed
rule. Every process on one GPU model runs the same kernels, and a cold start compiles one shape
per matrix instead of timing many. A multi-row plan is pinned per matrix for the projections'
tiles of 16 rows (the table's `m16`), so a row computes the same bits whatever the step's row
count.

No Triton here: the CPU suite tests the lookup.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

Blocks = tuple[int, int, int]  # BLOCK_N (weight rows a program), BLOCK_K (columns a tile), warps

TABLE_FILE = Path(__file__).with_name("gemv_blocks.json")
MM_FILE = Path(__file__).with_name("mm_plans.json")
KERNELS = ("norm_gemv", "gate_up_silu", "gemv_residual")
MM_KERNELS = ("norm_mm", "gate_up_silu_mm", "mm_residual")
# what bench.tune_gemv times: rows a program × columns a tile, at 4 and 8 warps
CANDIDATES: tuple[Blocks, ...] = tuple(
    (n, k, w)
    for n, k in ((1, 1024), (2, 512), (2, 1024), (4, 256), (4, 512), (4, 1024), (8, 256), (8, 512), (8, 1024),
                 (16, 256), (16, 512))
    for w in (4, 8))
INTERPRETER: Blocks = (4, 256, 4)  # TRITON_INTERPRET=1 (the CPU)


@dataclass(frozen=True)
class Plan:
    """How one multi-row projection [N, K] runs: column tiles of block_n, K in `splits` chunks of
    `chunk` columns (a multiple of block_k · ksplit), each a program. A program's K step is
    ksplit tiles of block_k columns multiplied side by side (one batched product, the program's
    warps each on its own tiles) and added up across them: K split inside the program."""
    block_n: int
    block_k: int
    splits: int
    chunk: int
    warps: int = 4
    ksplit: int = 1

    @property
    def split(self) -> bool:
        return self.splits > 1

    @property
    def step(self) -> int:
        """Columns of K a program multiplies at a time."""
        return self.block_k * self.ksplit

    @classmethod
    def of(cls, k: int, block_n: int, block_k: int, chunk: int, warps: int = 4, ksplit: int = 1) -> Plan:
        """The plan of K split into chunks of `chunk` columns (rounded up to a multiple of the K step)."""
        step = block_k * ksplit
        chunk = -(-min(chunk, k) // step) * step
        return cls(block_n, block_k, -(-k // chunk), chunk, warps, ksplit)

    def pinned(self) -> list[int]:
        """The table's entry: [block_n, block_k, chunk, warps], and ksplit where it is not 1."""
        return [self.block_n, self.block_k, self.chunk, self.warps, *([self.ksplit] if self.ksplit > 1 else [])]


WHOLE_K = 1024  # the widest K step: a program's whole weight slice of a narrow projection


def mm_candidates(k: int) -> list[Plan]:
    """What bench.tune_mm times for a projection of K columns: tiles of 16 to 64 columns, K steps of
    64 to 256, chunks of 1, 2 or 4 steps or all of K, 4 warps; and K steps of 512 and 1024 (up to
    K's next power of two) at 4 and 8 warps, whose first step, loaded before the wait for the
    previous kernel, is a program's whole chunk of the weights (as the decode's GEMVs)."""
    plans = [Plan.of(k, bn, bk, steps * bk if steps else k)
             for bn in (16, 32, 64) for bk in (64, 128, 256) for steps in (1, 2, 4, 0)]
    wide = [bk for bk in (512, WHOLE_K) if bk < 2 * k]
    plans += [Plan.of(k, bn, bk, bk, warps) for bn in (16, 32) for bk in wide for warps in (4, 8)]
    return list(dict.fromkeys(plans + ksplit_candidates(k)))


def ksplit_candidates(k: int) -> list[Plan]:
    """Plans that split K inside a program (Plan.ksplit): tiles of 16 or 32 columns, K steps of 512,
    1024 or 2048 columns (up to K's next power of two) as 4 to 16 tiles, at least one a warp,
    chunks of one step or all of K."""
    top = max(512, 1 << (k - 1).bit_length())
    plans = [Plan.of(k, bn, step // ks, chunk, warps, ks)
             for bn in (16, 32) for step in (512, 1024, 2048) if step <= top
             for ks in (4, 8, 16) if step // ks >= 32 for warps in (4, 8) if ks >= warps
             for chunk in (step, k)]
    return list(dict.fromkeys(plans))


def key(kernel: str, n: int, k: int) -> str:
    """The table's key of one matrix: its kernel, output rows N and columns K."""
    return f"{kernel} {n}x{k}"


def mm_key(kernel: str, n: int, k: int, block_m: int) -> str:
    """The multi-row table's key: its kernel, N, K and the rows a tile."""
    return f"{kernel} {n}x{k} m{block_m}"


@functools.cache
def _read(path: Path) -> dict[str, dict[str, tuple[int, ...]]]:
    raw = json.loads(path.read_text()) if path.exists() else {}
    return {gpu: {k: tuple(int(x) for x in v) for k, v in shapes.items()} for gpu, shapes in raw.items()}


def table() -> dict[str, dict[str, Blocks]]:
    """GPU model name (torch.cuda.get_device_name) -> key -> GEMV blocks."""
    return _read(TABLE_FILE)  # type: ignore[return-value]


def mm_table() -> dict[str, dict[str, tuple[int, ...]]]:
    """GPU model name -> mm_key -> [block_n, block_k, chunk, warps]."""
    return _read(MM_FILE)


def rule(n: int, k: int) -> Blocks:
    """Blocks for a matrix the table lacks: tiles of up to 512 columns, 4 warps (the reduction
    order depends on these two alone), and rows a program so that the grid has at least 512
    programs where N allows."""
    block_k = min(512, max(256, 1 << (k - 1).bit_length()))
    block_n = 1
    while block_n < 16 and n // (2 * block_n) >= 512:
        block_n *= 2
    return block_n, block_k, 4


def mm_rule(n: int, k: int, sms: int) -> Plan:
    """A multi-row plan for a matrix the table lacks: 32 columns a tile (64 past 16384), 128 columns
    of K a step (64 below K = 1024), and K split until there are about two programs per
    multiprocessor."""
    block_n = 32 if n <= 16384 else 64
    block_k = 128 if k >= 1024 else 64
    tiles = -(-n // block_n)
    splits = max(1, min(-(-k // block_k), -(-2 * sms // tiles)))
    return Plan.of(k, block_n, block_k, -(-k // splits))


def lookup(kernel: str, n: int, k: int, gpu: str) -> Blocks:
    """The pinned blocks of one matrix on one GPU model."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown GEMV kernel {kernel!r}; known: {KERNELS}")
    return table().get(gpu, {}).get(key(kernel, n, k)) or rule(n, k)


def mm_lookup(kernel: str, n: int, k: int, block_m: int, gpu: str, sms: int, pinned: bool = True) -> Plan:
    """The pinned plan of one multi-row projection on one GPU model (the rule without `pinned`:
    fp32 steps, whose tiles take twice the shared memory the table was measured with)."""
    if kernel not in MM_KERNELS:
        raise ValueError(f"unknown multi-row kernel {kernel!r}; known: {MM_KERNELS}")
    entry = mm_table().get(gpu, {}).get(mm_key(kernel, n, k, block_m)) if pinned else None
    return Plan.of(k, *entry) if entry else mm_rule(n, k, sms)


def merged(gpu: str, measured: dict[str, tuple[int, ...]], path: Path = TABLE_FILE) -> str:
    """A table file's text with `measured` entries set for `gpu` (others kept): sorted, a matrix a line."""
    out = {g: dict(shapes) for g, shapes in _read(path).items()}
    out.setdefault(gpu, {}).update(measured)
    gpus = [f' {json.dumps(g)}: {{\n' + ",\n".join(f'  {json.dumps(k)}: {json.dumps(list(v))}'
                                                   for k, v in sorted(shapes.items())) + "\n }"
            for g, shapes in sorted(out.items())]
    return "{\n" + ",\n".join(gpus) + "\n}\n"
