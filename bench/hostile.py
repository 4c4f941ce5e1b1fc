"""Hostile clients against the running services, one JSON line each:

  fairness   one client opens --greedy-streams streams and never reads them; another client's
             time to its first token (--samples requests one after another), against the same
             request on the idle stack: the delay at the median and at the worst
  big        --big-requests concurrent requests of --big-ids token ids each (4 bytes an id on
             the wire, about); the gateway's peak resident memory over its memory before,
             and the status each request got

  python -m bench.hostile --greedy-streams 64 --big-requests 3 --big-ids 20000000
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import grpc

from bench.prompts import CHAT_PROMPTS
from bench.spec_vs_baseline import git_commit
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig


def first_token_ms(addr: str, prompt: str, max_new: int) -> float:
    client = GatewayClient(addr)
    t0 = time.perf_counter()
    call = client.call(make_request(prompt, max_new_tokens=max_new, ignore_eos=True), timeout=600)
    next(call)
    ms = (time.perf_counter() - t0) * 1e3
    call.cancel()
    client.close()
    return ms


def memory_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def fairness(stack: ServiceStack, a: argparse.Namespace) -> dict:
    addr = stack.addr("gateway")
    idle = [first_token_ms(addr, CHAT_PROMPTS[1], a.max_new_tokens) for _ in range(a.samples)]
    greedy = GatewayClient(addr)
    calls, refused = [], 0
    for i in range(a.greedy_streams):  # opened, never read
        call = greedy.call(make_request(CHAT_PROMPTS[i % len(CHAT_PROMPTS)], max_new_tokens=a.max_new_tokens,
                                        ignore_eos=True), timeout=600)
        calls.append(call)
    time.sleep(a.settle_s)
    for c in calls:
        if c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            refused += 1
    loaded = [first_token_ms(addr, CHAT_PROMPTS[1], a.max_new_tokens) for _ in range(a.samples)]
    for c in calls:
        c.cancel()
    greedy.close()
    return {"bench": "hostile", "case": "fairness", "greedy_streams": a.greedy_streams,
            "greedy_refused": refused, "first_token_ms_idle": [round(x, 1) for x in idle],
            "first_token_ms_beside_greedy": [round(x, 1) for x in loaded],
            "delay_ms_median": round(statistics.median(loaded) - statistics.median(idle), 1),
            "delay_ms_worst": round(max(loaded) - statistics.median(idle), 1)}


def big_requests(stack: ServiceStack, a: argparse.Namespace) -> dict:
    addr, pid = stack.addr("gateway"), stack.procs["gateway"].pid
    before = memory_kb(pid, "VmRSS")
    codes: list[str] = []

    def one() -> None:
        client = GatewayClient(addr)
        try:
            client.generate(make_request(token_ids=[7] * a.big_ids, max_new_tokens=4), timeout=120)
            codes.append("OK")
        except grpc.RpcError as e:
            codes.append(e.code().name)
        client.close()

    threads = [threading.Thread(target=one) for _ in range(a.big_requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    peak = memory_kb(pid, "VmHWM")
    return {"bench": "hostile", "case": "big", "requests": a.big_requests, "token_ids_each": a.big_ids,
            "codes": codes, "gateway_rss_mb_before": round(before / 1024, 1),
            "gateway_peak_rss_mb": round(peak / 1024, 1), "peak_over_before_mb": round((peak - before) / 1024, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-sequences", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy-streams", type=int, default=64)
    p.add_argument("--settle-s", type=float, default=3.0, help="before the other client's requests")
    p.add_argument("--samples", type=int, default=5, help="first tokens timed, idle and beside the greedy client")
    p.add_argument("--big-requests", type=int, default=3)
    p.add_argument("--big-ids", type=int, default=20_000_000)
    p.add_argument("--log-dir", default="/tmp/specsplit-hostile")
    a = p.parse_args()
    cfg = StackConfig.of(model=a.model, max_sequences=a.max_sequences, log_dir=Path(a.log_dir))
    with ServiceStack(cfg) as stack:
        for row in (big_requests(stack, a), fairness(stack, a)):
            print(json.dumps({**row, "model": a.model, "commit": git_commit(), "machine": platform.machine()}),
                  flush=True)


if __name__ == "__main__":
    main()
