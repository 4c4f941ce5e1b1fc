"""One step of the draft's fused head, replayed from a CUDA graph: what a chain's step (one row
a sequence) or a tree level (topk rows) costs on the GPU, with the projections after attention
on the tensor cores (kernels.projections, `tc`) against the decode's GEMVs over every row
(kernels.few, `few`). Random bf16 weights of --shape's head (SmolLM2-135M's by default), a
context of --start committed entries; µs a step, the mean of --iters replays of a graph of 20
steps after warm-up runs.

  python -m bench.head_step --rows 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from bench.spec_vs_baseline import git_commit
from bench.tune_gemv import time_launch
from specsplit.checkpoints.shapes import SHAPES
from specsplit.models.batch import Batch
from specsplit.models.config import Eagle3Config
from specsplit.models.eagle3 import Eagle3Head
from specsplit.models.fused_head import FusedHead

STEPS_A_GRAPH = 20


def random_head(shape: str, draft_vocab: int) -> Eagle3Head:
    t = SHAPES[shape]
    cfg = Eagle3Config(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_heads=t.num_heads,
                       num_kv_heads=t.num_kv_heads, vocab_size=t.vocab_size, draft_vocab_size=draft_vocab,
                       head_dim=t.head_dim)
    torch.manual_seed(0)
    with torch.device("cuda"):
        head = Eagle3Head(cfg).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return head.to(torch.bfloat16)


def step_us(head: Eagle3Head, few_rows: int, rows: int, start: int, ctx: int, iters: int) -> float:
    """µs of one fused head step of `rows` rows of one sequence (a level: each row sees the
    committed entries and itself) in a cache of `ctx` entries a slot."""
    fused = FusedHead(head, few_rows=few_rows)
    cache = head.new_cache(4, ctx)
    entries = torch.arange(start, start + rows, device="cuda").view(1, rows)  # [1, T]
    keys = torch.arange(ctx, device="cuda")
    visible = ((keys < start) | (keys[None, :] == entries[0, :, None]))[None]  # [1, T, ctx]
    hidden = torch.randn(1, rows, head.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)  # pre-norm states
    tokens = torch.randint(0, head.cfg.draft_vocab_size, (rows,), device="cuda")
    batch = Batch.padded(torch.full((1, rows), start, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda"),
                         entries, ctx, visible=visible, hidden=hidden)
    with torch.inference_mode():
        return time_launch(lambda: fused.forward(tokens, batch, cache), STEPS_A_GRAPH, iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--rows", default="1,2,4,8", help="rows of a step")
    p.add_argument("--start", type=int, default=300, help="committed entries before the step")
    p.add_argument("--context", type=int, default=512, help="KV entries a slot (the views' width)")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    if a.start + 8 > a.context:
        raise SystemExit(f"--start {a.start} leaves no room for the step's rows in --context {a.context}")
    if not torch.cuda.is_available():
        raise SystemExit("bench.head_step needs a CUDA device")
    head = random_head(a.shape, a.draft_vocab)
    for rows in (int(r) for r in a.rows.split(",")):
        tc, few = (step_us(head, few_rows, rows, a.start, a.context, a.iters) for few_rows in (0, 8))
        print(json.dumps({"bench": "head_step", "shape": a.shape, "rows": rows, "tc_us": round(tc, 2),
                          "few_us": round(few, 2), "tc_over_few": round(tc / few, 3),
                          "gpu": torch.cuda.get_device_name(), "commit": git_commit(),
                          "machine": platform.machine()}), flush=True)


if __name__ == "__main__":
    main()
