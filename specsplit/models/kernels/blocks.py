"""Block shapes of the one-token GEMV kernels (kernels.decode), pinned per GPU model.

A GEMV's block shape sets its reduction order along K (BLOCK_K, and the warps a tile is split
over), so in bf16 two processes that picked different shapes round some logits apart and can
decode different tokens. The shapes are therefore never tuned at run time: they come from
`gemv_blocks.json`, measured once per GPU model with `python -m bench.tune_gemv --write`, or,
for a GPU model or a matrix the table lacks, from a fixed rule. Every process on one GPU model
runs the same kernels, and a cold start compiles one shape per matrix instead of timing many.

No Triton here: the CPU suite tests the lookup.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

Blocks = tuple[int, int, int]  # BLOCK_N (weight rows a program), BLOCK_K (columns a tile), warps

TABLE_FILE = Path(__file__).with_name("gemv_blocks.json")
KERNELS = ("norm_gemv", "gate_up_silu", "gemv_residual")
# what bench.tune_gemv times: rows a program × columns a tile, at 4 and 8 warps
CANDIDATES: tuple[Blocks, ...] = tuple(
    (n, k, w)
    for n, k in ((1, 1024), (2, 512), (2, 1024), (4, 256), (4, 512), (4, 1024), (8, 256), (8, 512), (8, 1024),
                 (16, 256), (16, 512))
    for w in (4, 8))
INTERPRETER: Blocks = (4, 256, 4)  # TRITON_INTERPRET=1 (the CPU)


def key(kernel: str, n: int, k: int) -> str:
    """The table's key of one matrix: its kernel, output rows N and columns K."""
    return f"{kernel} {n}x{k}"


@functools.cache
def table() -> dict[str, dict[str, Blocks]]:
    """GPU model name (torch.cuda.get_device_name) -> key -> blocks."""
    raw = json.loads(TABLE_FILE.read_text())
    return {gpu: {k: (int(v[0]), int(v[1]), int(v[2])) for k, v in shapes.items()} for gpu, shapes in raw.items()}


def rule(n: int, k: int) -> Blocks:
    """Blocks for a matrix the table lacks: tiles of up to 512 columns, 4 warps (the reduction
    order depends on these two alone), and rows a program so that the grid has at least 512
    programs where N allows."""
    block_k = min(512, max(256, 1 << (k - 1).bit_length()))
    block_n = 1
    while block_n < 16 and n // (2 * block_n) >= 512:
        block_n *= 2
    return block_n, block_k, 4


def lookup(kernel: str, n: int, k: int, gpu: str) -> Blocks:
    """The pinned blocks of one matrix on one GPU model."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown GEMV kernel {kernel!r}; known: {KERNELS}")
    return table().get(gpu, {}).get(key(kernel, n, k)) or rule(n, k)


def merged(gpu: str, measured: dict[str, Blocks]) -> str:
    """The table file's text with `measured` entries set for `gpu` (others kept): sorted, a matrix a line."""
    out = {g: dict(shapes) for g, shapes in table().items()}
    out.setdefault(gpu, {}).update(measured)
    gpus = [f' {json.dumps(g)}: {{\n' + ",\n".join(f'  {json.dumps(k)}: {json.dumps(list(v))}'
                                                   for k, v in sorted(shapes.items())) + "\n }"
            for g, shapes in sorted(out.items())]
    return "{\n" + ",\n".join(gpus) + "\n}\n"
