"""Tracing overhead: tokens/s with every cycle sampled to the jsonl file exporter,
against tracing off, on the same model. Two stacks run side by side and requests
alternate between them (ABBA order), so drift hits both alike. Prints JSON lines.

  python -m bench.tracing_overhead --rounds 3 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.prompts import CHAT_PROMPTS
from bench.spec_vs_baseline import git_commit
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.observability.trace_report import load_jsonl


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--head", default="random")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--num-steps", type=int, default=3)
    a = p.parse_args()
    trace_dir = Path(tempfile.mkdtemp(prefix="specsplit-traces-"))
    traced_env = {"OTEL_TRACES_EXPORTER": "jsonl", "OTEL_METRICS_EXPORTER": "jsonl",
                  "SPECSPLIT_TRACE_DIR": str(trace_dir), "OTEL_TRACES_SAMPLER": "always_on"}
    base = dict(model=a.model, head=a.head, max_context=1024, max_sequences=2)
    t0 = time.time()
    totals = {"off": [0, 0.0], "on": [0, 0.0]}  # tokens, seconds
    with ServiceStack(StackConfig.of(**base)) as off, ServiceStack(StackConfig.of(**base, env=traced_env)) as on:
        clients = {"off": GatewayClient(off.addr("gateway")), "on": GatewayClient(on.addr("gateway"))}
        for c in clients.values():  # warm-up
            c.generate(make_request(CHAT_PROMPTS[0], max_new_tokens=4))
        for r in range(a.rounds):
            for i, prompt in enumerate(CHAT_PROMPTS[: a.prompts]):
                order = ["off", "on"] if (r + i) % 2 == 0 else ["on", "off"]
                for mode in order:
                    g = clients[mode].generate(make_request(prompt, max_new_tokens=a.max_new_tokens, ignore_eos=True,
                                                            num_steps=a.num_steps))
                    totals[mode][0] += len(g.token_ids)
                    totals[mode][1] += g.final.elapsed_ms / 1e3
        for c in clients.values():
            c.close()
    spans = load_jsonl([trace_dir])
    rows = {m: {"tracing": m, "tokens": t, "tokens_per_s": round(t / s, 3)} for m, (t, s) in totals.items()}
    for row in rows.values():
        print(json.dumps(row))
    print(json.dumps({
        "summary": "tokens/s traced (every cycle, jsonl file exporter) / untraced",
        "ratio": round(rows["on"]["tokens_per_s"] / rows["off"]["tokens_per_s"], 4),
        "spans_written": len(spans), "cycle_spans": sum(s["name"] == "cycle" for s in spans),
        "model": a.model, "num_steps": a.num_steps, "commit": git_commit(), "wall_s": round(time.time() - t0, 1),
    }))


if __name__ == "__main__":
    main()
