"""Aggregate tokens/s with N concurrent streams against the same N requests one at a
time, through the running services (per-cycle batching at work). JSON lines.

  python -m bench.concurrency --streams 1,8,32 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from bench.prompts import CHAT_PROMPTS
from bench.spec_vs_baseline import git_commit
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig


def run(addr: str, n: int, concurrent: bool, max_new: int, steps: int) -> tuple[int, float]:
    reqs = [make_request(CHAT_PROMPTS[i % len(CHAT_PROMPTS)], max_new_tokens=max_new, ignore_eos=True,
                         num_steps=steps, speculation=steps > 0) for i in range(n)]
    counts = [0] * n

    def one(i: int) -> None:
        client = GatewayClient(addr)
        counts[i] = len(client.generate(reqs[i], timeout=3600).token_ids)
        client.close()

    t0 = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(n):
            one(i)
    return sum(counts), time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--head", default="random")
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--num-steps", default="0,3")
    a = p.parse_args()
    streams = [int(x) for x in a.streams.split(",")]
    t_start = time.time()
    with ServiceStack(StackConfig.of(model=a.model, head=a.head, max_context=512, max_sequences=max(streams))) as st:
        addr = st.addr("gateway")
        run(addr, 1, False, 4, 0)  # warm-up
        for steps in [int(x) for x in a.num_steps.split(",")]:
            for n in streams:
                tok_c, s_c = run(addr, n, True, a.max_new_tokens, steps)
                tok_s, s_s = (tok_c, s_c) if n == 1 else run(addr, n, False, a.max_new_tokens, steps)
                print(json.dumps({
                    "streams": n, "num_steps": steps, "tokens": tok_c,
                    "concurrent_tokens_per_s": round(tok_c / s_c, 3),
                    "one_at_a_time_tokens_per_s": round(tok_s / s_s, 3),
                    "ratio": round((tok_c / s_c) / (tok_s / s_s), 3), "model": a.model, "head": a.head,
                }), flush=True)
    print(json.dumps({"commit": git_commit(), "wall_s": round(time.time() - t_start, 1)}))


if __name__ == "__main__":
    main()
