"""End to end at batch 1: a target and its trained EAGLE-3 head, greedy, every prompt
generating exactly --max-new-tokens (ignore_eos), decode tokens/s of
  - target-only in one process (the target runtime with CUDA graphs, a plain loop, no gRPC, up to
    --target-only-decode tokens a call): the baseline speculation must beat;
  - speculation in one process (the same loop with the draft runtime): where each cycle's time goes;
  - target-only and speculation through the three services (gRPC streams + the hidden-state ring);
  - HF transformers `generate` on the same weights, plain and with prompt lookup (an outside reference).
One JSON line per (mode, num_steps), then a summary line with the ratios over the in-process
target-only baseline, the commit and the machine. With --forced-acceptance (a shape with a random
head: nothing would be accepted) each verify accepts a number of drafts drawn from a per-depth
profile, the draft ranks its trees' candidates by the same profile (specsplit.forced), and every
line says so in "acceptance".

  python -m bench.end_to_end --device cuda:0 --draft-device cuda:0          # one H200
  python -m bench.end_to_end --device cpu --draft-device cpu --dtype float32 --prompts 1 --max-new-tokens 32 \\
      --num-steps 3 --hf-prompts 1                                          # CPU smoke
  python -m bench.end_to_end --model shape:llama-3.1-8b --head random --forced-acceptance shipped \\
      --num-steps 5 --topk 4 --num-draft-tokens 16 --fused-decode pdl       # the 8B shape, one H200
  python -m bench.end_to_end --model shape:llama-3.1-8b --head random --forced-acceptance shipped \\
      --num-steps 5 --topk 4 --num-draft-tokens 16 --tp-size 8 --draft-device cuda:0   # the services' target at TP8
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import cycle_overhead
from bench.gpu_handoff import mps_daemon
from bench.prompts import CHAT_PROMPTS, token_prompts
from bench.spec_vs_baseline import git_commit
from specsplit.checkpoints.eagle_head import trained_head_dir
from specsplit.checkpoints.target_checkpoint import load_target_config, resolve_target_dir
from specsplit.tokenizer import TextCodec


def timed_generate(model: Any, ids: torch.Tensor, new: int, extra: dict[str, Any]) -> tuple[float, torch.Tensor]:
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0, **extra)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def hf_generate(a: argparse.Namespace, prompts: list[list[int]], refs: list[list[int]]) -> list[dict[str, Any]]:
    """HF transformers on the converted checkpoint: plain greedy, then prompt lookup decoding."""
    from transformers import AutoModelForCausalLM  # only this reference needs transformers

    model = AutoModelForCausalLM.from_pretrained(resolve_target_dir(a.model), dtype=getattr(torch, a.dtype))
    model = model.to(a.device).eval()
    rows = []
    for label, extra in (("hf_generate", {}), ("hf_generate_prompt_lookup", {"prompt_lookup_num_tokens": 10})):
        for warm in (True, False):
            chosen = prompts[:1] if warm else prompts
            tokens, seconds, same = 0, 0.0, 0
            for p, ref in zip(chosen, refs, strict=False):
                ids = torch.tensor([p], device=a.device)
                first_s, _ = timed_generate(model, ids, 1, {})  # prefill + first token, subtracted below
                total_s, out = timed_generate(model, ids, a.max_new_tokens, extra)
                seconds += total_s - first_s
                new = out[0, len(p):].tolist()
                tokens += len(new) - 1
                same += new == ref[len(p):len(p) + a.max_new_tokens]
            if not warm:
                rows.append({"mode": label, "prompts": len(chosen), "decode_tokens_per_s": round(tokens / seconds, 2),
                             "same_tokens_as_in_process_target_only": round(same / len(chosen), 3),
                             "note": "after the first token: generate(max_new_tokens=1) time subtracted"})
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--head", default="default", help="EAGLE-3 head (default: the shipped one for --model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda:0", help="the target's device")
    p.add_argument("--draft-device", default="cuda:0")
    p.add_argument("--backend", default="", help="hidden-state handoff (default: cuda_ipc on CUDA, else shm)")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=8, help="chat prompts from bench/prompts.py")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--num-steps", default="1,2,3,4,5,6,7")
    p.add_argument("--inline-steps", action="store_true", help="services run steps on their event loop thread")
    p.add_argument("--grpc-steps", action="store_true",
                   help="the gateway's Steps over the gRPC streams (default: the services' Unix step sockets)")
    cycle_overhead.add_compile_args(p)
    cycle_overhead.add_fused_args(p)
    p.add_argument("--topk", type=int, default=1, help="> 1: the draft proposes trees branching topk ways")
    p.add_argument("--num-draft-tokens", type=int, default=16, help="a tree's size counting the root (trees only)")
    p.add_argument("--hf-prompts", type=int, default=3, help="prompts for the HF generate reference (0: skip it)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--forced-acceptance", default="", help="benchmark mode for heads without trained weights: each "
                   "verify accepts a number of drafts drawn from this per-depth profile ('shipped' or rates, "
                   "specsplit.forced), and the draft ranks its trees' candidates by it; every line says so")
    p.add_argument("--target-only-decode", type=int, default=16, help="in-process target-only decoding: up to "
                   "this many tokens a call (decoding ahead; 1: a token a call); the services' as their gateway's "
                   "--decode-ahead-ms says")
    p.add_argument("--adaptive", action="store_true", help="through the services also requests that leave num_steps "
                   "unset: the gateway chooses each cycle's steps (trees of --topk/--num-draft-tokens among them)")
    cycle_overhead.add_variant_args(p)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    a.accept_rate = None  # the real draft: no replay
    a.backend = a.backend or ("cuda_ipc" if a.device.startswith("cuda") else "shm")
    forced = cycle_overhead.forced(a)
    head_dir = trained_head_dir(a.head, a.model)
    if head_dir is None and forced is None:
        raise SystemExit(f"--head {a.head!r} resolves to a random head for {a.model!r}: nothing would be accepted "
                         "(--forced-acceptance measures such a head)")
    a.head = str(head_dir) if head_dir is not None else a.head
    steps_list = [int(x) for x in a.num_steps.split(",") if x]
    t0 = time.time()
    codec = TextCodec.from_checkpoint(resolve_target_dir(a.model))
    if codec is not None:
        prompts = [codec.encode(codec.render_chat(t)) for t in CHAT_PROMPTS[: a.prompts]]
    elif forced is not None:  # a shape without a tokenizer: prompts of 64 fixed token ids
        vocab = load_target_config(resolve_target_dir(a.model)).vocab_size
        prompts = token_prompts(vocab, a.prompts)
        a.hf_prompts = 0
    else:
        raise SystemExit(f"{a.model}: no tokenizer")
    refs, local = cycle_overhead.in_process(a, prompts, steps_list)
    remote: dict[str, dict[int, dict[str, Any]]] = {}
    for variant in a.variants.split(","):  # modes "services" (spin: the GPU default), "services_thread", ...
        with tempfile.TemporaryDirectory() as tmp:
            remote["services" if variant == "spin" else f"services_{variant}"] = cycle_overhead.services(
                a, prompts, refs, steps_list, Path(tmp), variant, a.adaptive)
    base = local[0]["decode_tokens_per_s"]
    common = {"bench": "end_to_end", "model": a.model, "head": Path(a.head).name, "dtype": a.dtype,
              "topk": a.topk, "num_draft_tokens": a.num_draft_tokens if a.topk > 1 else None,
              "max_new_tokens": a.max_new_tokens, "prompts": len(prompts),
              **({"acceptance": forced.label_for(trees=a.topk > 1)} if forced is not None else {})}
    summary: dict[str, Any] = {}
    for steps in [0, *steps_list]:
        for mode, row in (("in_process", local[steps]), *((m, r[steps]) for m, r in remote.items())):
            ratio = round(row["decode_tokens_per_s"] / base, 3)
            summary[f"{mode}_{'target_only' if steps == 0 else f'spec{steps}'}"] = ratio
            print(json.dumps({**common, **row, "mode": mode, "over_in_process_target_only": ratio}), flush=True)
    for mode, rows in remote.items():  # steps chosen per cycle: through the services only
        if cycle_overhead.ADAPTIVE in rows:
            row = rows[cycle_overhead.ADAPTIVE]
            ratio = summary[f"{mode}_adaptive"] = round(row["decode_tokens_per_s"] / base, 3)
            print(json.dumps({**common, **row, "mode": mode, "over_in_process_target_only": ratio}), flush=True)
    if a.hf_prompts:
        for row in hf_generate(a, prompts[: a.hf_prompts], refs):
            summary[row["mode"]] = round(row["decode_tokens_per_s"] / base, 3)
            print(json.dumps({**common, **row, "over_in_process_target_only": summary[row["mode"]]}), flush=True)
    best = max((k for k in summary if k.startswith("services_spec") or k == "services_adaptive"),
               key=summary.__getitem__, default=None)
    print(json.dumps({"bench": "end_to_end", "summary": "decode tokens/s over in-process target-only (graphs)",
                      **({"acceptance": forced.label_for(trees=a.topk > 1)} if forced is not None else {}),
                      "in_process_target_only_tokens_per_s": base, "ratios": summary, "best_services": best,
                      "target_device": a.device, "draft_device": a.draft_device, "inline_steps": a.inline_steps,
                      "step_transport": "grpc stream" if a.grpc_steps else "unix socket",
                      "compile": a.compile, "draft_compile": cycle_overhead.draft_compiles(a),
                      "fused_decode": a.fused_decode, "few_rows": a.few_rows, "draft_fused_head": a.draft_fused_head,
                      "variants": a.variants,
                      "spin_us": a.spin_us, "services_tp_size": a.tp_size,
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                      "mps": mps_daemon(), "commit": git_commit(), "machine": platform.machine(),
                      "wall_s": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
