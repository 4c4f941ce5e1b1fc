"""Cycle overhead of the services: the same draft and target (i) in one process
with a plain loop (bench.plain_loop) and (ii) as the three services (gRPC streams + the
hidden-state ring), batch 1, num_steps 1..7, greedy. Random weights accept nothing, so the
draft's proposals are replaced by the target's own continuation with mistakes at
--accept-rate: every line says "replayed acceptance". The real draft forward still runs.

Per num_steps one JSON line: decode tokens/s both ways and their ratio (ii)/(i), and per
cycle the µs of draft and verify engine time and of everything else (overhead).

  python -m bench.cycle_overhead --model shape:llama-3.1-8b --device cuda:0 --draft-device cuda:1
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.plain_loop import LoopRun, generate
from bench.replay import LABEL, Replayer
from bench.spec_vs_baseline import git_commit
from draft_service.config import FUSED_HEAD, DraftConfig
from draft_service.runtime import DraftRuntime
from specsplit.checkpoints.target_checkpoint import load_target_config, resolve_target_dir
from specsplit.cli.client import GatewayClient, Generation, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.forced import ForcedAcceptance
from specsplit.models.parallel import TensorParallel
from specsplit.observability.trace_report import load_jsonl
from target_service.config import FUSED_DECODE, TargetConfig
from target_service.runtime import TargetRuntime


def per_cycle(label: str, steps: int, tokens: int, decode_s: float, cycles: int, draft_ms: float, verify_ms: float
              ) -> dict[str, Any]:
    cycle_us = decode_s * 1e6 / cycles
    return {"mode": label, "num_steps": steps, "decode_tokens_per_s": round(tokens / decode_s, 2),
            "accepted_length": round(tokens / cycles, 3), "cycle_us": round(cycle_us, 1),
            "draft_us": round(draft_ms * 1e3 / cycles, 1), "verify_us": round(verify_ms * 1e3 / cycles, 1),
            "overhead_us": round(cycle_us - (draft_ms + verify_ms) * 1e3 / cycles, 1)}


def add_compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action="store_true", help="the target's and the draft's --compile")
    p.add_argument("--draft-compile", action="store_true", help="the draft's --compile only: its cycle graphs "
                   "compiled whole (CUDA)")
    p.add_argument("--draft-fused-head", default="auto", choices=FUSED_HEAD, help="the draft's --fused-head")


def draft_compiles(a: argparse.Namespace) -> bool:
    return a.compile or a.draft_compile


def in_process(a: argparse.Namespace, prompts: list[list[int]], steps_list: list[int]
               ) -> tuple[list[list[int]], dict[int, dict[str, Any]]]:
    target = TargetRuntime(TargetConfig(model=a.model, dtype=a.dtype, device=a.device, hidden_backend=a.backend,
                                        max_context=a.max_context, max_sequences=2, compile=a.compile,
                                        fused_decode=a.fused_decode, few_rows=a.few_rows,
                                        forced_acceptance=forced(a) is not None,
                                        max_draft_tokens=max(16, tree_size(a))).validate(), TensorParallel())
    draft = DraftRuntime(DraftConfig(head=a.head, target=a.model, dtype=a.dtype, device=a.draft_device,
                                     max_context=a.max_context, max_sequences=2, compile=draft_compiles(a),
                                     fused_head=a.draft_fused_head, max_topk=max(8, tree_topk(a)),
                                     benchmark_tree_profile=getattr(a, "forced_acceptance", "")).validate())
    assert target.writer is not None
    draft.attach(target.writer.descriptor)
    draft.warm_graphs()  # as the services do once attached
    ahead = getattr(a, "target_only_decode", 1)  # target-only: tokens a call (decoding ahead)
    try:
        for steps in [0, *steps_list]:  # warm-up: capture the graphs of every bucket the runs will use (forced
            # acceptance's extends of several tokens among them)
            generate(target, draft, prompts[0], a.max_new_tokens, steps, None, tree_topk(a), tree_size(a), forced(a),
                     ahead)
        base = [generate(target, None, p, a.max_new_tokens, 0, decode=ahead) for p in prompts]
        refs = [p + r.tokens for p, r in zip(prompts, base, strict=True)]
        rows = {0: {**summarize("in_process", 0, base), "decode_tokens_a_call": ahead}}
        for steps in steps_list:
            replayer = None if a.accept_rate is None else Replayer(refs, a.accept_rate, target.model.cfg.vocab_size)
            runs = [generate(target, draft, p, a.max_new_tokens, steps, replayer, tree_topk(a), tree_size(a),
                             forced(a)) for p in prompts]
            rows[steps] = summarize("in_process", steps, runs)
            # in bfloat16 a verify of k+1 rows may round a near-tie differently from a one-row decode; then the
            # sequence leaves its reference (and replayed acceptance falls): reported, not hidden
            rows[steps]["same_tokens_as_target_only"] = round(sum(
                r.tokens[: a.max_new_tokens] == b.tokens[: a.max_new_tokens] for r, b in zip(runs, base, strict=True))
                / len(runs), 3)
        return refs, rows
    finally:
        target.close()
        del target, draft
        gc.collect()
        torch.cuda.empty_cache()


def forced(a: argparse.Namespace) -> ForcedAcceptance | None:
    """The benchmark's forced acceptance profile (bench.end_to_end --forced-acceptance), if any."""
    return ForcedAcceptance.parse(getattr(a, "forced_acceptance", ""))


def tree_topk(a: argparse.Namespace) -> int:
    return getattr(a, "topk", 1)


def tree_size(a: argparse.Namespace) -> int:
    """A tree's num_draft_tokens (0 for chains)."""
    return getattr(a, "num_draft_tokens", 0) if tree_topk(a) > 1 else 0


def summarize(label: str, steps: int, runs: list[LoopRun]) -> dict[str, Any]:
    return per_cycle(label, steps, sum(len(r.tokens) - 1 for r in runs), sum(r.decode_s for r in runs),
                     sum(r.cycles for r in runs), sum(r.draft_ms for r in runs), sum(r.verify_ms for r in runs))


def shape(a: argparse.Namespace, steps: int) -> dict[str, int]:
    """The request's tree shape (nothing for chains and target-only)."""
    return {"topk": tree_topk(a), "num_draft_tokens": tree_size(a)} if steps and tree_topk(a) > 1 else {}


# the stack's control path (see --variants); "-ahead": with drafting ahead, the others without
VARIANTS = ("thread", "one-loop", "spin", "traced", "spin-ahead", "thread-ahead")


def client_side(gens: list[Generation]) -> dict[str, Any]:
    """What the client saw: decode tokens/s from the chunks' arrival times (after the first,
    the prefill's), and the gaps between chunks (a gap far above a cycle is a late delivery)."""
    tokens = sum(len(g.token_ids) - 1 for g in gens)
    seconds = sum(g.chunk_times[-1] - g.chunk_times[0] for g in gens if len(g.chunk_times) > 1)
    gaps = sorted((b - a) * 1e6 for g in gens for a, b in zip(g.chunk_times[1:], g.chunk_times[2:], strict=False))

    def pct(q: float) -> float:
        return round(gaps[min(len(gaps) - 1, int(q * len(gaps)))], 1) if gaps else 0.0

    return {"client_decode_tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else 0.0,
            "client_chunk_gap_us": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": pct(1.0)}}


def variant_args(variant: str, spin_us: float) -> tuple[list[str], list[str]]:
    """(gateway args, target and draft args) of a stack variant: `thread` the gateway's
    speculation loop on its own thread with blocking step sockets and no spinning, `one-loop`
    the gateway on one event loop (--no-loop-thread), `spin` `thread` with every step socket
    polled for spin_us before a blocking read (gateway and both services; on GPU stacks the
    default, 20000 µs), `traced` `spin` with every request traced (traced_env); `spin-ahead` and
    `thread-ahead` theirs with the gateway's --draft-ahead on (every other one with it off)."""
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
    spin = spin_us if variant in ("spin", "traced", "spin-ahead") else 0.0
    gateway = ["--no-loop-thread"] if variant == "one-loop" else ["--step-spin-us", str(spin)]
    gateway += ["--draft-ahead", "on" if variant.endswith("-ahead") else "off"]
    return gateway, ["--step-socket-spin-us", str(spin)]


def traced_env(folder: Path) -> dict[str, str]:
    """Every request sampled and every cycle traced, spans to jsonl files in `folder`."""
    return {"OTEL_TRACES_EXPORTER": "jsonl", "SPECSPLIT_TRACE_DIR": str(folder), "OTEL_TRACES_SAMPLER": "always_on"}


def add_fused_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fused-decode", choices=FUSED_DECODE, default="auto",
                   help="the target's --fused-decode, in process and in its service (default: auto, as served)")
    p.add_argument("--few-rows", type=int, default=-1,
                   help="the target's --few-rows, in process and in its service (default: -1, as served)")


ADAPTIVE = -1  # services' key of the requests that leave num_steps unset (steps chosen per cycle)


def services(a: argparse.Namespace, prompts: list[list[int]], refs: list[list[int]], steps_list: list[int],
             log_dir: Path, variant: str = "thread", adaptive: bool = False) -> dict[int, dict[str, Any]]:
    """Per num_steps (0: target-only; ADAPTIVE with `adaptive`: num_steps unset, the gateway
    choosing each cycle, trees of --topk/--num-draft-tokens among its candidates) one row."""
    replay: list[str] = []
    if a.accept_rate is not None:
        ref_file = log_dir / "references.json"
        ref_file.write_text(json.dumps(refs))
        replay = ["--replay-references", str(ref_file), "--replay-accept-rate", str(a.accept_rate)]
    engine_flags = (["--inline-steps"] if a.inline_steps else []) + (["--compile"] if a.compile else [])
    trees = ["--max-num-draft-tokens", str(max(16, tree_size(a)))]
    target_only: list[str] = []
    tree_profile: list[str] = []
    if forced(a) is not None:  # the gateway draws, the target commits, the draft's trees follow the profile
        trees += ["--benchmark-forced-acceptance", a.forced_acceptance]
        target_only = ["--benchmark-forced-acceptance"]
        tree_profile = ["--benchmark-tree-profile", a.forced_acceptance]
    gateway_extra, service_extra = variant_args(variant, a.spin_us)
    cfg = StackConfig.of(model=a.model, head=a.head, dtype=a.dtype, device=a.device, draft_device=a.draft_device,
                         hidden_backend=a.backend, max_context=a.max_context, max_sequences=2, log_dir=log_dir,
                         tp_size=a.tp_size,
                         extra_target_args=[*engine_flags, *target_only, *service_extra, "--max-draft-tokens",
                                            str(max(16, tree_size(a))), "--fused-decode", a.fused_decode,
                                            "--few-rows", str(a.few_rows)],
                         extra_draft_args=[*engine_flags, *(["--compile"] if a.draft_compile else []),
                                           "--fused-head", a.draft_fused_head,
                                           *service_extra, *tree_profile, "--max-topk", str(max(8, tree_topk(a)))],
                         extra_gateway_args=[*replay, *trees, *gateway_extra],
                         gateway_module="bench.replay_gateway" if replay else "gateway",
                         step_sockets=not a.grpc_steps,
                         env=traced_env(log_dir / "traces") if variant == "traced" else {})
    rows = {}
    with ServiceStack(cfg) as stack:
        client = GatewayClient(stack.addr("gateway"))
        try:
            runs = [0, *steps_list, *([ADAPTIVE] if adaptive else [])]

            def request(p: list[int], steps: int) -> Any:
                if steps == ADAPTIVE:
                    return make_request(token_ids=p, max_new_tokens=a.max_new_tokens, ignore_eos=True, **shape(a, 1))
                return make_request(token_ids=p, max_new_tokens=a.max_new_tokens, ignore_eos=True, num_steps=steps,
                                    speculation=steps > 0, **shape(a, steps))

            for steps in runs:  # warm-up: every bucket the runs will use
                client.generate(request(prompts[0], steps), timeout=600)
            for steps in runs:
                gens = [client.generate(request(p, steps), timeout=600) for p in prompts]
                same = round(sum(list(g.token_ids) == r[len(p) : len(p) + a.max_new_tokens]
                                 for g, r, p in zip(gens, refs, prompts, strict=True)) / len(gens), 3)
                decode_s = sum(g.final.elapsed_ms - g.final.first_token_ms for g in gens) / 1e3
                s = [g.final.speculation for g in gens]
                cycles = sum(x.cycles for x in s) if steps else sum(len(g.token_ids) - 1 for g in gens)
                rows[steps] = per_cycle("services", steps, sum(len(g.token_ids) - 1 for g in gens), decode_s,
                                        cycles, sum(x.draft_compute_ms for x in s),
                                        sum(x.verify_compute_ms for x in s))
                if steps == ADAPTIVE:
                    rows[steps]["num_steps"] = "adaptive"
                    rows[steps]["cycles_by_steps"] = [sum(col) for col in zip(*(
                        list(x.num_steps_histogram) + [0] * (9 - len(x.num_steps_histogram)) for x in s),
                        strict=True)]
                rows[steps]["same_tokens_as_in_process_target_only"] = same
                rows[steps]["tp_size"] = a.tp_size
                rows[steps].update(client_side(gens))
                rows[steps]["draft_rpc_us"] = round(sum(x.draft_ms for x in s) * 1e3 / cycles, 1)
                rows[steps]["verify_rpc_us"] = round(sum(x.verify_ms for x in s) * 1e3 / cycles, 1)
                # the services' whole handling of each call: rpc less this is transport and the gateway's
                # encoding, this less draft_us / verify_us the service's host work around its engine
                rows[steps]["draft_service_us"] = round(sum(x.draft_service_ms for x in s) * 1e3 / cycles, 1)
                rows[steps]["verify_service_us"] = round(sum(x.verify_service_ms for x in s) * 1e3 / cycles, 1)
                ahead = sum(x.draft_ahead_hits + x.draft_ahead_misses for x in s)
                if ahead:  # cycles whose next drafts were ready at once
                    rows[steps]["draft_ahead_hit_rate"] = round(sum(x.draft_ahead_hits for x in s) / ahead, 3)
        finally:
            client.close()
    if variant == "traced":  # the stack has stopped: every span is written
        spans = load_jsonl([log_dir / "traces"])
        for row in rows.values():
            row["spans_written"], row["cycle_spans"] = len(spans), sum(x["name"] == "cycle" for x in spans)
    return rows


def add_variant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default="spin", help="comma list of (ii)'s control path: spin (every step socket "
                   "polled --spin-us before blocking: the GPU default), thread (no spinning), one-loop (also the "
                   "gateway's --no-loop-thread), traced (spin, every request traced to jsonl files), spin-ahead "
                   "and thread-ahead (spin and thread with the gateway's --draft-ahead on; the others: off)")
    p.add_argument("--spin-us", type=float, default=20_000.0)
    p.add_argument("--tp-size", type=int, default=1, help="the services' target over this many ranks (GPUs "
                   "--device's index and the next ones; gloo on the CPU); the in-process loop stays on one")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shape:llama-3.1-8b")
    p.add_argument("--head", default="random")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda:0", help="the target's GPU")
    p.add_argument("--draft-device", default="cuda:1")
    p.add_argument("--backend", default="cuda_ipc")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-steps", default="1,2,3,4,5,6,7")
    p.add_argument("--accept-rate", type=float, default=0.8)
    p.add_argument("--inline-steps", action="store_true", help="services run steps on their event loop thread")
    p.add_argument("--grpc-steps", action="store_true",
                   help="the gateway's Steps over the gRPC streams (default: the services' Unix step sockets)")
    add_compile_args(p)
    add_fused_args(p)
    add_variant_args(p)
    a = p.parse_args()
    steps_list = [int(x) for x in a.num_steps.split(",") if x]
    t0 = time.time()
    g = torch.Generator().manual_seed(0)
    vocab = load_target_config(resolve_target_dir(a.model)).vocab_size
    prompts = [torch.randint(0, vocab - 1, (a.prompt_tokens,), generator=g).tolist() for _ in range(a.prompts)]
    refs, local = in_process(a, prompts, steps_list)
    variants = a.variants.split(",")
    remote = {}
    for variant in variants:
        with tempfile.TemporaryDirectory() as tmp:
            remote[variant] = services(a, prompts, refs, steps_list, Path(tmp), variant)
    for steps in [0, *steps_list]:
        for variant in variants:
            i, ii = local[steps], remote[variant][steps]
            print(json.dumps({
                "bench": "cycle_overhead", "label": LABEL if steps else "target-only", "model": a.model,
                "num_steps": steps, "accept_rate": a.accept_rate if steps else None,
                "ratio_services_over_in_process": round(ii["decode_tokens_per_s"] / i["decode_tokens_per_s"], 4),
                "cycle_ratio_in_process_over_services": round(i["cycle_us"] / ii["cycle_us"], 4),
                # the control path alone: (ii)'s own engine times with (i)'s overhead, over (ii)'s cycle
                "control_path_ratio": round((ii["draft_us"] + ii["verify_us"] + i["overhead_us"]) / ii["cycle_us"], 4),
                "in_process": i, "services": ii, "target_device": a.device, "draft_device": a.draft_device,
                "inline_steps": a.inline_steps, "step_transport": "grpc stream" if a.grpc_steps else "unix socket",
                "stack_variant": variant, "spin_us": a.spin_us if variant == "spin" else 0,
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            }), flush=True)
    print(json.dumps({"bench": "cycle_overhead", "label": LABEL, "commit": git_commit(),
                      "wall_s": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
