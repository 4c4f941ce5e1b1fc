"""Where an in-process speculation cycle's time goes: for target-only decoding, chains and trees,
the engines' time per cycle (what bench.end_to_end reports as draft_us / verify_us) against the
GPU time of the kernels they ran (torch.profiler, CUDA graphs on; the draft on its own GPU so
that each GPU's kernels belong to one engine), the CUDA API calls that wait, and the host's
busiest operators. Engine time well above its kernels' time means the host, not the GPU,
decides the step. Before any profiling (once used, the profiler's instrumentation stays in the
process and slows every CUDA call), the same run without it, and each engine's last graph replayed
alone: `verify_host_us` (`draft_host_us`) is the engine's time a cycle minus that replay, its
host work around its kernels, and that graph's kernels profiled (`verify_graph`, `draft_graph`:
count, GPU µs and the heaviest by name, a replay), with the host time of its launch from an idle
GPU and its time until done (`*_launch`), and the parts of each engine's step timed by wrapping
them (`verify_parts_us`, `draft_parts_us`: the target's packing of its inputs, each engine's graph
runs (filling the graph's inputs, the launch, the wait for the readback), the whole runner step, the
ring write; the draft's checks of the features' references and the unpacking of its proposals).
One JSON line per mode, then a summary line.

  python -m bench.cycle_anatomy --model shape:smollm2-135m --device cuda:0 --draft-device cuda:1
  python -m bench.cycle_anatomy --model <SmolLM2 GGUF> --head default ...   # the real head
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

from bench import cycle_overhead
from bench.plain_loop import generate
from bench.spec_vs_baseline import git_commit
from draft_service import engine as draft_engine_module
from draft_service.config import FUSED_HEAD, DraftConfig
from draft_service.runtime import DraftRuntime
from specsplit.models.parallel import TensorParallel
from specsplit.runner import runner as runner_module
from target_service.config import TargetConfig
from target_service.runtime import TargetRuntime

WAITING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy",
                 "cudaGraphLaunch", "cudaLaunchKernel", "cudaEventSynchronize")


def profile_run(target: TargetRuntime, draft: DraftRuntime, prompt: list[int], new: int, steps: int, topk: int,
                tree: int, top: int) -> dict[str, Any]:
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run = generate(target, draft if steps else None, prompt, new, steps, None, topk, tree)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    cycles = run.cycles
    gpu_us: dict[str, float] = defaultdict(float)
    kernels: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            gpu_us[f"cuda:{ev.device_index}"] += ev.device_time_total
            kernels[f"cuda:{ev.device_index}"] += 1
    averages = prof.key_averages()
    api = {e.key: {"calls_per_cycle": round(e.count / cycles, 2), "us_per_cycle": round(e.cpu_time_total / cycles, 1)}
           for e in averages if e.key in WAITING_CALLS}
    host = sorted((e for e in averages if not e.key.startswith("cuda") and e.self_cpu_time_total > 0),
                  key=lambda e: -e.self_cpu_time_total)[:top]
    return {"num_steps": steps, "topk": topk if steps else None, "num_draft_tokens": tree or None,
            "cycles": cycles, "accepted_length": round((len(run.tokens) - 1) / cycles, 3),
            "cycle_us_profiled": round(run.decode_s * 1e6 / cycles, 1),
            "draft_engine_us": round(run.draft_ms * 1e3 / cycles, 1),
            "verify_engine_us": round(run.verify_ms * 1e3 / cycles, 1),
            "gpu_kernel_us": {d: round(t / cycles, 1) for d, t in sorted(gpu_us.items())},
            "kernels_per_cycle": {d: round(n / cycles, 1) for d, n in sorted(kernels.items())},
            "cuda_api": api,
            "host_ops_self_us": [{"op": e.key[:80], "calls_per_cycle": round(e.count / cycles, 2),
                                  "us_per_cycle": round(e.self_cpu_time_total / cycles, 1)} for e in host]}


@contextlib.contextmanager
def timed(spent: dict[str, float], name: str, owner: object, attr: str) -> Iterator[None]:
    """Add the wall time of every call of owner.attr to spent[name] while inside."""
    fn = getattr(owner, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0

    setattr(owner, attr, wrapper)
    try:
        yield
    finally:
        setattr(owner, attr, fn)


def replay_alone(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """µs a replay of `graph`, timed alone."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def launch_costs(graph: torch.cuda.CUDAGraph, replays: int) -> dict[str, float]:
    """From an idle GPU: µs of host time in `graph.replay()` (the launch), and µs until the
    replay is done (launch, kernels, synchronisation), each a median of `replays`."""
    launch, done = [], []
    for _ in range(replays):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        launch.append(t1 - t0)
        done.append(time.perf_counter() - t0)
    return {"launch_host_us": round(sorted(launch)[replays // 2] * 1e6, 1),
            "replay_and_sync_us": round(sorted(done)[replays // 2] * 1e6, 1)}


def graph_kernels(graph: torch.cuda.CUDAGraph, replays: int, top: int) -> dict[str, Any]:
    """The kernels of one replay of `graph` (torch.profiler over `replays` replays): their count,
    GPU µs, and the `top` heaviest by name with calls and µs a replay."""
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += 1
            per[ev.name][1] += ev.device_time_total
    heavy = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": round(sum(n for n, _ in per.values()) / replays, 1),
            "kernel_us": round(sum(us for _, us in per.values()) / replays, 1),
            "top": [{"kernel": name[:90], "calls": round(n / replays, 2), "us": round(us / replays, 1)}
                    for name, (n, us) in heavy]}


def unprofiled(target: TargetRuntime, draft: DraftRuntime, prompt: list[int], new: int, steps: int, topk: int,
               tree: int, replays: int = 50) -> tuple[dict[str, Any], dict[str, torch.cuda.CUDAGraph]]:
    """Engine µs per cycle without the profiler, the parts of each engine's step (see the
    module's docstring), and the last verify graph's and draft graph's replay µs, timed alone
    (`*_host_us`: the engine's time a cycle minus that), and those graphs (to profile later)."""
    spent: dict[str, float] = defaultdict(float)
    assert target.writer is not None
    drafted: dict[str, float] = defaultdict(float)
    with (timed(spent, "pack", runner_module, "pack_rows"),
          timed(spent, "graph_run", target.engine.runner.graphs, "run"),
          timed(spent, "runner_step", target.engine.runner, "verify"),
          timed(spent, "ring_write", target.writer, "write_all"),
          timed(drafted, "check_and_read", draft.engine, "_check_and_read"),
          timed(drafted, "graph_run", draft.engine.runner.graphs, "run"),
          timed(drafted, "unpack", draft_engine_module, "unpack_trees")):
        run = generate(target, draft if steps else None, prompt, new, steps, None, topk, tree)
    verify_us = run.verify_ms * 1e3 / run.cycles
    row = {"draft_engine_us": round(run.draft_ms * 1e3 / run.cycles, 1), "verify_engine_us": round(verify_us, 1),
           "verify_parts_us": {k: round(v * 1e6 / run.cycles, 1) for k, v in spent.items()},
           "draft_parts_us": {k: round(v * 1e6 / run.cycles, 1) for k, v in drafted.items()}}
    graphs = {}
    for name, runtime, engine_us in (("verify", target, verify_us),
                                     ("draft", draft, run.draft_ms * 1e3 / run.cycles if steps else 0.0)):
        graph = runtime.engine.runner.graphs.last
        if graph is not None and engine_us:
            replay_us = replay_alone(graph, replays)
            row |= {f"{name}_replay_us": round(replay_us, 1), f"{name}_host_us": round(engine_us - replay_us, 1),
                    f"{name}_launch": launch_costs(graph, replays)}
            graphs[name] = graph
    return row, graphs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shape:smollm2-135m")
    p.add_argument("--head", default="random")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--draft-device", default="cuda:1")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=96, help="per profiled run (the warm-up runs it too)")
    p.add_argument("--num-steps", default="0,3,5", help="0: target-only; the others as chains and as trees")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--num-draft-tokens", type=int, default=16)
    p.add_argument("--top", type=int, default=12, help="host operators and graph kernels listed per mode")
    p.add_argument("--draft-fused-head", default="auto", choices=FUSED_HEAD, help="the draft's --fused-head")
    p.add_argument("--draft-compile", action="store_true", help="the draft's --compile: cycle graphs compiled whole")
    cycle_overhead.add_fused_args(p)
    a = p.parse_args()
    t0 = time.time()
    backend = "cuda_ipc" if a.device.startswith("cuda") else "shm"  # as bench.end_to_end and the services
    target = TargetRuntime(TargetConfig(model=a.model, dtype=a.dtype, device=a.device, hidden_backend=backend,
                                        max_context=1024, max_sequences=2, max_draft_tokens=max(16, a.num_draft_tokens),
                                        fused_decode=a.fused_decode, few_rows=a.few_rows).validate(),
                           TensorParallel())
    draft = DraftRuntime(DraftConfig(head=a.head, target=a.model, dtype=a.dtype, device=a.draft_device,
                                     max_context=1024, max_sequences=2, max_topk=max(8, a.topk),
                                     compile=a.draft_compile, fused_head=a.draft_fused_head).validate())
    assert target.writer is not None
    draft.attach(target.writer.descriptor)
    draft.warm_graphs()  # as the services do once attached
    prompt = [100 + (i * 37) % 5000 for i in range(a.prompt_tokens)]
    modes = [(s, 1, 0) for s in (int(x) for x in a.num_steps.split(",") if x)]
    modes += [(s, a.topk, a.num_draft_tokens) for s, _, _ in modes if s > 0]
    summary: dict[str, Any] = {}
    clean: list[tuple[dict[str, Any], dict[str, torch.cuda.CUDAGraph]]] = []
    try:
        for steps, topk, tree in modes:  # every mode unprofiled first: the profiler slows what runs after it
            generate(target, draft if steps else None, prompt, a.max_new_tokens, steps, None, topk, tree)  # warm-up
            clean.append(unprofiled(target, draft, prompt, a.max_new_tokens, steps, topk, tree))
        for (steps, topk, tree), (timings, graphs) in zip(modes, clean, strict=True):
            row = profile_run(target, draft, prompt, a.max_new_tokens, steps, topk, tree, a.top)
            row["unprofiled"] = timings | {f"{name}_graph": graph_kernels(graph, 10, a.top)
                                          for name, graph in graphs.items()}
            name = "target_only" if not steps else f"{'tree' if tree else 'chain'}{steps}"
            summary[name] = {"draft_engine_us": row["draft_engine_us"], "verify_engine_us": row["verify_engine_us"],
                             "gpu_kernel_us": row["gpu_kernel_us"], "unprofiled": row["unprofiled"]}
            print(json.dumps({"bench": "cycle_anatomy", "mode": name, "model": a.model, "head": a.head,
                              "dtype": a.dtype, "fused_decode": a.fused_decode,
                              "draft_compile": a.draft_compile, "draft_fused_head": a.draft_fused_head, **row}),
                  flush=True)
    finally:
        target.close()
    print(json.dumps({"bench": "cycle_anatomy", "summary": "engine µs per cycle against their GPUs' kernel µs",
                      "target_device": a.device, "draft_device": a.draft_device, "per_mode": summary,
                      "note": "profiled runs: the profiler's own cost is in the engine times",
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                      "commit": git_commit(), "machine": platform.machine(), "wall_s": round(time.time() - t0, 1)}),
          flush=True)


if __name__ == "__main__":
    main()
