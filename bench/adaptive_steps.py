"""Steps chosen per cycle against every fixed setting, on a mixed prompt set (code, chat,
repetitive text), through the three services, one stack, batch 1, greedy. The settings are
interleaved: for each prompt, every setting in turn (the order rotating from prompt to prompt),
so that a machine's drift falls on all of them alike; --rounds repeats the whole. A warm-up
(speculation off and a 1-step chain on one prompt) comes first; the adaptive requests
(num_steps unset) learn costs and acceptance as they go, as in serving. One JSON line per
setting (decode tokens/s over all prompts, tau, cycles by drafted steps, whether the tokens
equal speculation off's), then a summary with adaptive over the best fixed setting.

  python -m bench.adaptive_steps                                          # CPU, the embedded default
  python -m bench.adaptive_steps --device cuda:0 --dtype bfloat16 --fused-decode pdl \\
      --hidden-backend cuda_ipc --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from bench.prompts import MIXED_PROMPTS
from bench.spec_vs_baseline import git_commit
from specsplit.cli.client import GatewayClient, Generation, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig


def fixed_settings(chains: list[int], trees: list[tuple[int, int, int]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"off": {"speculation": False}}
    out.update({f"chain{k}": {"num_steps": k, "topk": 1} for k in chains})
    out.update({f"tree{k}x{topk}n{n}": {"num_steps": k, "topk": topk, "num_draft_tokens": n} for k, topk, n in trees})
    return out


def one(client: GatewayClient, prompt: str, max_new: int, settings: dict[str, Any]) -> Generation:
    return client.generate(make_request(prompt, max_new_tokens=max_new, ignore_eos=True, **settings), timeout=900)


def row(label: str, gens: list[Generation], off: list[Generation] | None) -> dict[str, Any]:
    tokens = sum(len(g.token_ids) - 1 for g in gens)
    seconds = sum(g.final.elapsed_ms - g.final.first_token_ms for g in gens) / 1e3
    spec = [g.final.speculation for g in gens]
    cycles = sum(s.cycles for s in spec)
    steps: Counter[int] = Counter()
    for s in spec:
        steps.update({i: n for i, n in enumerate(s.num_steps_histogram) if n})
    out: dict[str, Any] = {"bench": "adaptive_steps", "setting": label, "tokens": tokens,
                           "decode_tokens_per_s": round(tokens / seconds, 2),
                           "tau": round(sum(s.mean_accepted_length * s.cycles for s in spec) / cycles, 3)
                           if cycles else 1.0,
                           "cycles_by_steps": dict(sorted(steps.items())),
                           "prompt_tokens_per_s": per_prompt(gens)}
    if off is not None:
        out["same_tokens_as_off"] = all(list(g.token_ids) == list(o.token_ids) for g, o in zip(gens, off, strict=True))
    return out


def per_prompt(gens: list[Generation]) -> list[float]:
    """Decode tokens/s of each of MIXED_PROMPTS over the rounds (the generations come round by round)."""
    tokens, seconds = [0] * len(MIXED_PROMPTS), [0.0] * len(MIXED_PROMPTS)
    for j, g in enumerate(gens):
        tokens[j % len(MIXED_PROMPTS)] += len(g.token_ids) - 1
        seconds[j % len(MIXED_PROMPTS)] += (g.final.elapsed_ms - g.final.first_token_ms) / 1e3
    return [round(t / s, 1) if s else 0.0 for t, s in zip(tokens, seconds, strict=True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--head", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--draft-device", default="")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--fused-decode", default="auto")
    p.add_argument("--hidden-backend", default="")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--chains", default="1,2,3,4,5", help="fixed chain depths to compare")
    p.add_argument("--rounds", type=int, default=1, help="times the whole interleaved set runs")
    p.add_argument("--trees", default="3x4n8", help="fixed trees DEPTHxTOPKnTOKENS to compare ('' for none); the "
                   "adaptive requests get the first one's branching and size as their tree candidates")
    a = p.parse_args()
    chains = [int(x) for x in a.chains.split(",") if x]
    trees = [tuple(int(v) for v in t.replace("x", " ").replace("n", " ").split()) for t in a.trees.split(",") if t]
    settings = fixed_settings(chains, trees)  # type: ignore[arg-type]
    # num_steps unset: chosen per cycle, the first tree's branching and size among the candidates
    settings["adaptive"] = {"topk": trees[0][1], "num_draft_tokens": trees[0][2]} if trees else {"topk": 1}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = StackConfig.of(model=a.model, head=a.head, device=a.device, draft_device=a.draft_device or None,
                             dtype=a.dtype, max_context=a.max_context, max_sequences=2, log_dir=Path(tmp),
                             hidden_backend=a.hidden_backend or None,
                             extra_target_args=["--fused-decode", a.fused_decode])
        with ServiceStack(cfg) as stack:
            client = GatewayClient(stack.addr("gateway"))
            try:
                for warm in ({"speculation": False}, {"num_steps": 1, "topk": 1}):
                    one(client, MIXED_PROMPTS[0], 16, warm)
                gens: dict[str, list[Generation]] = {label: [] for label in settings}
                labels = list(settings)
                for r in range(a.rounds):
                    for i, prompt in enumerate(MIXED_PROMPTS):
                        turn = (i + r) % len(labels)
                        for label in labels[turn:] + labels[:turn]:
                            gens[label].append(one(client, prompt, a.max_new_tokens, settings[label]))
                    print(f"adaptive_steps: round {r + 1} of {a.rounds} done", file=sys.stderr, flush=True)
            finally:
                client.close()
    rows = {label: row(label, g, None if label == "off" else gens["off"]) for label, g in gens.items()}
    base = rows["off"]["decode_tokens_per_s"]
    for r in rows.values():
        r["over_off"] = round(r["decode_tokens_per_s"] / base, 3)
        print(json.dumps(r), flush=True)
    best = max((k for k in rows if k != "adaptive"), key=lambda k: rows[k]["decode_tokens_per_s"])
    print(json.dumps({
        "bench": "adaptive_steps", "summary": "decode tokens/s, mixed prompts (code, chat, repetitive), batch 1",
        "best_fixed": best, "adaptive_over_best_fixed": round(rows["adaptive"]["decode_tokens_per_s"]
                                                              / rows[best]["decode_tokens_per_s"], 3),
        "all_same_tokens": all(r.get("same_tokens_as_off", True) for r in rows.values()),
        "model": a.model, "head": a.head, "device": a.device, "dtype": a.dtype, "prompts": len(MIXED_PROMPTS),
        "max_new_tokens": a.max_new_tokens, "rounds": a.rounds,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(),
        "commit": git_commit(), "machine": platform.machine(), "wall_s": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
