"""Per-cycle cost of the three services as processes, on a tiny model (compute close to
nothing, so what is left is the serving path): wall µs per cycle and the CPU µs each
process (target, draft, gateway) burns per cycle, with the gateway's Steps over the gRPC
streams and over the Unix step sockets, in one run, and with the gateway streaming every
cycle's tokens or gathering them (`--stream-intervals 1,16`), and the gateway's CPU per
thread (`main` serves the clients; the speculation loop has a thread of its own, `spec-loop`,
except in the `one-loop` variant). One JSON line per run, then the means.

  python -m bench.stack_cpu_time --tokens 1000 --requests 2 --rounds 2
  python -m bench.stack_cpu_time --transports socket --stream-intervals 1,16
  python -m bench.stack_cpu_time --transports socket --variants thread,one-loop,spin
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.cycle_overhead import add_variant_args, variant_args
from bench.spec_vs_baseline import git_commit
from specsplit.checkpoints.eagle_head import random_head, save_head
from specsplit.checkpoints.target_checkpoint import load_target_config
from specsplit.checkpoints.tiny import tiny_config, write_tiny_target
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig


def _stat_cpu_seconds(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_seconds(pid: int) -> float:
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of each live thread, named `main` (the process's first thread: the event loop
    of every service) or by its kernel name and id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = "main" if int(tid) == pid else f"{stat[stat.index('(') + 1:stat.rindex(')')]}-{tid}"
        out[name] = _stat_cpu_seconds(stat)
    return out


def run(model: Path, head: Path, sockets: bool, steps: int, tokens: int, requests: int, interval: int = 1,
        variant: str = "thread", spin_us: float = 0.0) -> dict:
    gateway_extra, service_extra = variant_args(variant, spin_us)
    cfg = StackConfig.of(model=str(model), head=str(head), num_steps=steps, threads=1, step_sockets=sockets,
                         log_dir=Path(tempfile.mkdtemp(prefix="stack-cpu-")),
                         extra_gateway_args=["--stream-interval", str(interval), *gateway_extra],
                         extra_target_args=service_extra, extra_draft_args=service_extra)
    with ServiceStack(cfg) as stack:
        client = GatewayClient(stack.addr("gateway"))
        client.generate(make_request(token_ids=[1, 2, 3], max_new_tokens=16, num_steps=steps))  # warm-up
        pids = {name: p.pid for name, p in stack.procs.items()}
        before = {n: cpu_seconds(p) for n, p in pids.items()}
        gw_threads_before = thread_cpu_seconds(pids["gateway"])
        t0 = time.perf_counter()
        gens = [client.generate(make_request(token_ids=[5, 6, 7 + i], max_new_tokens=tokens, ignore_eos=True,
                                             num_steps=steps)) for i in range(requests)]
        wall = time.perf_counter() - t0
        after = {n: cpu_seconds(p) for n, p in pids.items()}
        gw_threads = {n: c - gw_threads_before.get(n, 0.0) for n, c in thread_cpu_seconds(pids["gateway"]).items()}
        client.close()
    cycles = sum(g.final.speculation.cycles for g in gens)
    verify_us = sum(g.final.speculation.verify_compute_ms for g in gens) / cycles * 1e3
    draft_us = sum(g.final.speculation.draft_compute_ms for g in gens) / cycles * 1e3
    return {"bench": "stack_cpu_time", "transport": "unix socket" if sockets else "grpc stream", "num_steps": steps,
            "stream_interval": interval, "variant": variant,
            "cycles": cycles, "tokens": sum(len(g.token_ids) for g in gens),
            "wall_us_per_cycle": round(wall / cycles * 1e6), "cpu_us_per_cycle": {
                n: round((after[n] - before[n]) / cycles * 1e6) for n in pids},
            "gateway_threads_cpu_us_per_cycle": {  # threads alive at the end that used >= 1 µs a cycle
                n: round(c / cycles * 1e6) for n, c in sorted(gw_threads.items(), key=lambda kv: -kv[1])
                if c / cycles * 1e6 >= 1},
            "verify_compute_us_per_cycle": round(verify_us), "draft_compute_us_per_cycle": round(draft_us),
            "outside_compute_us_per_cycle": round(wall / cycles * 1e6 - verify_us - draft_us)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="each configuration this many times, alternating")
    p.add_argument("--transports", default="grpc,socket")
    p.add_argument("--stream-intervals", default="1", help="the gateway's --stream-interval values to compare")
    add_variant_args(p)
    p.set_defaults(variants="thread")  # the CPU stack's default: spinning threads would take the engines' cores
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="stack-cpu-"))
    model = write_tiny_target(tmp / "target", tiny_config(), seed=1)
    head_cfg, weights = random_head(load_target_config(model), draft_vocab_size=384, seed=2, std=0.2)
    save_head(tmp / "head", head_cfg, weights)
    transports = {"grpc": "grpc stream", "socket": "unix socket"}
    configs = [(t, int(i), v) for t in a.transports.split(",") for i in a.stream_intervals.split(",")
               for v in a.variants.split(",")]
    rows = []
    for _ in range(a.rounds):  # alternating, so that drifts of a shared machine hit all alike
        for transport, interval, variant in configs:
            rows.append(run(model, tmp / "head", transport == "socket", a.num_steps, a.tokens, a.requests, interval,
                            variant, a.spin_us))
            print(json.dumps(rows[-1]), flush=True)

    def label(transport: str, interval: int, variant: str) -> str:
        return f"{transports[transport]}, interval {interval}, {variant}"

    def mean(config: tuple[str, int, str], value: Callable[[dict], float]) -> int:
        transport, interval, variant = config
        vals = [value(r) for r in rows if (r["transport"], r["stream_interval"], r["variant"])
                == (transports[transport], interval, variant)]
        return round(sum(vals) / len(vals))

    print(json.dumps({"bench": "stack_cpu_time", "summary": True, "rounds": a.rounds,
                      "wall_us_per_cycle": {label(*c): mean(c, lambda r: r["wall_us_per_cycle"]) for c in configs},
                      "outside_compute_us_per_cycle": {label(*c): mean(c, lambda r: r["outside_compute_us_per_cycle"])
                                                       for c in configs},
                      "gateway_cpu_us_per_cycle": {label(*c): mean(c, lambda r: r["cpu_us_per_cycle"]["gateway"])
                                                   for c in configs},
                      "commit": git_commit(), "machine": platform.machine(), "cpus": os.cpu_count(),
                      "python": platform.python_version()}), flush=True)


if __name__ == "__main__":
    main()
