"""Speculation off vs on against running services: tokens/s, mean accepted length, and
the per-cycle time split into draft, verify and everything else. One JSON line per
configuration, then one line of ratios.

  python -m bench.spec_vs_baseline                      # starts the embedded default stack
  python -m bench.spec_vs_baseline --addr 127.0.0.1:50051 --num-steps 1,3,5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from typing import Any

from bench.prompts import CHAT_PROMPTS
from specsplit.cli.client import GatewayClient, Generation, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig


def git_commit() -> str:
    """The commit measured: SPECSPLIT_COMMIT where set (a copy of the tree on another machine), else git's HEAD."""
    if os.environ.get("SPECSPLIT_COMMIT"):
        return os.environ["SPECSPLIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def aggregate(label: str, steps: int, gens: list[Generation]) -> dict[str, Any]:
    tokens = sum(len(g.token_ids) for g in gens)
    elapsed = sum(g.final.elapsed_ms for g in gens)
    decode_ms = sum(g.final.elapsed_ms - g.final.first_token_ms for g in gens)
    s = [g.final.speculation for g in gens]
    cycles = sum(x.cycles for x in s)
    emitted = sum(sum(i * n for i, n in enumerate(x.accepted_length_histogram)) for x in s)
    per = (lambda v: round(v / cycles, 3)) if cycles else (lambda v: 0.0)
    draft, verify = sum(x.draft_compute_ms for x in s), sum(x.verify_compute_ms for x in s)
    draft_rpc, verify_rpc = sum(x.draft_ms for x in s), sum(x.verify_ms for x in s)
    return {
        "config": label, "num_steps": steps, "requests": len(gens), "tokens": tokens,
        "tokens_per_s": round(tokens / (elapsed / 1e3), 3),
        "decode_tokens_per_s": round((tokens - len(gens)) / (decode_ms / 1e3), 3) if decode_ms else 0.0,
        "mean_accepted_length": round(emitted / cycles, 4) if cycles else 0.0, "cycles": cycles,
        "cycle_ms": per(decode_ms), "cycle_draft_ms": per(draft), "cycle_verify_ms": per(verify),
        "cycle_other_ms": per(decode_ms - draft - verify),
        "cycle_draft_rpc_ms": per(draft_rpc), "cycle_verify_rpc_ms": per(verify_rpc),
        "mean_first_token_ms": round(sum(g.final.first_token_ms for g in gens) / len(gens), 3),
    }


def run(addr: str, prompts: list[str], max_new: int, steps_list: list[int], warmup: int) -> list[dict[str, Any]]:
    client = GatewayClient(addr)
    info = client.model_info()
    rows = []
    try:
        for p in prompts[:warmup]:
            client.generate(make_request(p, max_new_tokens=8))
        for steps in [0, *steps_list]:
            label = "target_only" if steps == 0 else "speculative"
            gens = [client.generate(make_request(p, max_new_tokens=max_new, ignore_eos=True, num_steps=steps,
                                                 speculation=steps > 0)) for p in prompts]
            row = aggregate(label, steps, gens)
            row.update(model=info.model_name, draft=info.draft_name or "none")
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        client.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--addr", default=None, help="a running gateway; default: start the embedded stack")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--head", default="random")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-steps", default="1,3,5")
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args()
    steps = [int(x) for x in a.num_steps.split(",") if x]
    prompts = CHAT_PROMPTS[: a.prompts]
    t0 = time.time()
    if a.addr:
        rows = run(a.addr, prompts, a.max_new_tokens, steps, a.warmup)
    else:
        with ServiceStack(StackConfig.of(model=a.model, head=a.head, max_context=2048)) as stack:
            rows = run(stack.addr("gateway"), prompts, a.max_new_tokens, steps, a.warmup)
    base = rows[0]["tokens_per_s"]
    print(json.dumps({
        "summary": "speculative / target_only tokens/s",
        "ratios": {f"steps_{r['num_steps']}": round(r["tokens_per_s"] / base, 4) for r in rows[1:]},
        "commit": git_commit(), "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": __import__("os").cpu_count(), "wall_s": round(time.time() - t0, 1),
    }), flush=True)


if __name__ == "__main__":
    main()
