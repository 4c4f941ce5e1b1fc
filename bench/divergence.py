"""Where speculative greedy output leaves target-only greedy output, and why: for each prompt,
target-only decoding against speculation (chains and trees) in the same dtype; at the first
token where they differ, the target's own logits there (one teacher-forced forward over the
common prefix, in that dtype and in float32): the two candidates, their margin, and what
float32 picks. A margin within the dtype's rounding of the logits means a near-tie that a
wider verify forward may round the other way (bf16 keeps 8 bits of mantissa); a large margin
would be a bug. One JSON line per (prompt, mode), then a summary line.

  python -m bench.divergence --device cpu --dtype bfloat16 --prompts 8 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from typing import Any

import torch

from bench.prompts import CHAT_PROMPTS
from bench.spec_vs_baseline import git_commit
from draft_service.config import DraftConfig
from gateway.local import LocalEngines
from gateway.scheduler import GenerationRequest
from specsplit.checkpoints.target_checkpoint import resolve_target_dir
from specsplit.models.batch import Batch
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import TensorParallel
from specsplit.ops import Sampling
from specsplit.tokenizer import TextCodec
from target_service.config import TargetConfig
from target_service.runtime import build_model


def next_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """The model's logits [V] for the token after `ids`, in one forward from scratch."""
    cache = model.new_cache(1, len(ids))
    tokens = torch.tensor(ids, device=model.embed_tokens.weight.device)
    with torch.inference_mode():
        logits, _ = model(tokens, Batch.sequence(tokens), cache)
    return logits[-1].float()


def bf16_step(x: float) -> float:
    """The distance between adjacent bf16 values around x (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 0.0


def load(model_dir: str, dtype: str, device: str) -> LlamaModel:
    """The target as the target service builds it."""
    return build_model(TargetConfig(model=model_dir, dtype=dtype, device=device), TensorParallel())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--head", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=8, help="chat prompts from bench/prompts.py")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--modes", default="chain3,tree5", help="chainK or treeK (topk 4, 16 verified)")
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.time()
    model_dir = str(resolve_target_dir(a.model))
    codec = TextCodec.from_checkpoint(model_dir)
    assert codec is not None
    prompts = [codec.encode(codec.render_chat(t)) for t in CHAT_PROMPTS[: a.prompts]]
    engines = LocalEngines(TargetConfig(model=model_dir, dtype=a.dtype, device=a.device, max_context=1024,
                                        max_draft_tokens=16),
                           DraftConfig(head=a.head, target=model_dir, dtype=a.dtype, device=a.device, max_context=1024))
    stop: set[int] = set()  # every prompt runs its full length (no EOS), as bench.end_to_end does

    def run(steps: int, topk: int) -> list[list[int]]:
        reqs = [GenerationRequest(q, a.max_new_tokens, Sampling(), stop, steps, topk, 16 if topk > 1 else 0)
                for q in prompts]
        return [r.tokens for r in engines.generate(reqs)]

    base = run(0, 1)
    outs = {m: run(int(m[5:]) if m.startswith("chain") else int(m[4:]), 1 if m.startswith("chain") else 4)
            for m in a.modes.split(",") if m}
    engines.close()
    models = {"run": load(model_dir, a.dtype, a.device), "float32": load(model_dir, "float32", a.device)}
    summary: dict[str, Any] = {}
    for mode, spec in outs.items():
        same, margins = 0, []
        for i, (q, b, s) in enumerate(zip(prompts, base, spec, strict=True)):
            at = next((j for j, (x, y) in enumerate(zip(b, s, strict=False)) if x != y), None)
            row: dict[str, Any] = {"bench": "divergence", "mode": mode, "prompt": i, "identical": at is None}
            if at is None:
                same += 1
            else:
                prefix = q + b[:at]
                run_logits, fp32_logits = next_logits(models["run"], prefix), next_logits(models["float32"], prefix)
                tb, ts = b[at], s[at]
                margin = float(run_logits[tb] - run_logits[ts])
                margins.append(margin)
                row.update(first_difference_at=at, target_only_token=tb, speculative_token=ts,
                           logit_target_only=round(float(run_logits[tb]), 4),
                           logit_speculative=round(float(run_logits[ts]), 4), margin=round(margin, 4),
                           float32_margin=round(float(fp32_logits[tb] - fp32_logits[ts]), 4),
                           float32_picks=int(fp32_logits.argmax()),
                           bf16_step_at_logit=bf16_step(float(run_logits[tb])))
            print(json.dumps(row), flush=True)
        summary[mode] = {"identical": f"{same}/{len(prompts)}",
                         "max_abs_margin_at_divergence": round(max((abs(m) for m in margins), default=0.0), 4)}
    print(json.dumps({"bench": "divergence", "summary": summary, "model": a.model, "dtype": a.dtype,
                      "device": a.device, "max_new_tokens": a.max_new_tokens, "commit": git_commit(),
                      "machine": platform.machine(), "wall_s": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
