"""Variants of the fused decode step at one shape, in one process (its ablations): the model
is built once and each variant decodes with graphs of its own (bench.decode_hbm.decode).

  attention blocks  (keys per iteration, warps) of the attention kernel
  no-attention      the attention kernel replaced by a view of q: wrong tokens, an upper bound
                    on what a free attention would give
  no-pdl            the same kernels without programmatic dependent launch

  python -m bench.fused_variants --attention-blocks 64x4,128x4,128x8,256x8
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

from bench import decode_hbm
from specsplit.checkpoints.shapes import SHAPES
from specsplit.models.llama import LlamaModel


def run(model: LlamaModel, prompt: torch.Tensor, name: str, tokens: int, pdl: bool = True,
        block: tuple[int, int] | None = None, attention: Callable[..., torch.Tensor] | None = None,
        bound: float = 0.0) -> dict[str, Any]:
    from specsplit.models.kernels import decode as decode_kernels  # Triton: CUDA machines only

    saved_block, saved_attention = decode_kernels.ATTENTION_BLOCK, decode_kernels.rope_attention
    decode_kernels.ATTENTION_BLOCK = block or saved_block
    decode_kernels.rope_attention = attention or saved_attention
    try:
        dt, out = decode_hbm.decode(model, "fused-pdl" if pdl else "fused", prompt, tokens,
                                    prompt.shape[0] + tokens + 16)
    finally:
        decode_kernels.ATTENTION_BLOCK, decode_kernels.rope_attention = saved_block, saved_attention
    row = {"bench": "fused_variants", "variant": name, "shape": model.cfg.name, "tokens": tokens,
           "ms_per_token": round(dt / tokens * 1e3, 4), "first_tokens": out[:4]}
    if bound:
        row["fraction_of_bound"] = round(tokens / dt / bound, 4)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--attention-blocks", default="128x4,128x8,256x8", help="comma list of KEYSxWARPS")
    p.add_argument("--hbm-tb-s", type=float, default=4.8)
    a = p.parse_args()
    model, g = decode_hbm.random_model(SHAPES[a.shape])
    prompt = torch.randint(0, model.cfg.vocab_size, (32,), device="cuda", generator=g)  # as decode_hbm's
    bound = a.hbm_tb_s * 1e12 / sum(t.numel() * t.element_size() for t in model.parameters())
    q_width = model.cfg.num_heads * model.cfg.head_dim
    rows = [run(model, prompt, "default", a.tokens, bound=bound)]
    for spec in a.attention_blocks.split(","):
        keys, warps = (int(x) for x in spec.split("x"))
        rows.append(run(model, prompt, f"attention {spec}", a.tokens, block=(keys, warps), bound=bound))
    rows.append(run(model, prompt, "no-pdl", a.tokens, pdl=False, bound=bound))
    rows.append(run(model, prompt, "no-attention (upper bound, wrong tokens)", a.tokens,
                    attention=lambda qkv, *_, **__: qkv[:q_width], bound=bound))
    rows.append(run(model, prompt, "default again", a.tokens, bound=bound))
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
