"""The serving curve: N concurrent client streams through the services, for each N of --streams and
each mode of --modes (speculation off, chains, trees, steps chosen per cycle), every stream
--max-new-tokens tokens (ignore_eos) of a chat prompt from bench/prompts.py (greedy, or sampled at --temperature,
the prompt's index its seed), each client on a connection of its own.
One JSON line per (mode, N):
  aggregate tokens/s over the wall time of the N streams (prefill included),
  time to first token p50 / p99 (ms from the call to the first token, the stream's connection
  made before),
  time per output token p50 / p99 (ms, a stream's (last token - first token) / (tokens - 1)),
  the ratio of aggregate tokens/s to the same mode at the first N (1 by default) and, for the
  speculating modes, to speculation off at the same N, the mean accepted length, and the
  share of streams whose tokens equal their prompt's stream run alone in the same mode (batch
  invariance: 1.0 in fp32; in bf16, rows padded into other batches may round near-ties apart),
  and the CUDA graphs the services captured during the run and during its warm-up run (each
  held up every stream: the services' Stats).
Each (mode, N) first runs once with --warmup-tokens tokens a stream (warm-up: the CUDA graphs of
that batch size's shapes are captured on first use; 8 by default, as many as the run for a
steady state), then --rounds times, the modes interleaved round by round: tokens/s is the median
of its rounds (each round's in "rounds_tokens_per_s"), the latencies' percentiles are over every
stream of every round. A model without a tokenizer (a shape, `shape:smollm2-135m`: random weights)
gets prompts of 64 fixed token ids; with --forced-acceptance its random head's drafts are accepted
as a profile says (specsplit.forced: the gateway draws, the target commits, the draft ranks its
trees by it) and every line says so in "acceptance". --decode-ahead-ms A,B,...: the whole run once
per value of the gateway's flag (a stack each, one after the other), each row also against the
first value's same (mode, N).

  python -m bench.concurrency --streams 1,2,4,8 --max-new-tokens 32                      (CPU)
  python -m bench.concurrency --device cuda:0 --dtype bfloat16 --head default --fused-decode pdl \\
      --hidden-backend cuda_ipc --streams 1,2,4,8,16,32,64 --max-new-tokens 128
  python -m bench.concurrency --model shape:smollm2-135m --forced-acceptance shipped --device cuda:0 \\
      --dtype bfloat16 --fused-decode pdl --hidden-backend cuda_ipc          (no checkpoint to stage)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc

from bench.prompts import CHAT_PROMPTS, token_prompts
from bench.spec_vs_baseline import git_commit
from specsplit.checkpoints.target_checkpoint import load_target_config, resolve_target_dir
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.forced import ForcedAcceptance
from specsplit.tokenizer import TextCodec


@dataclass
class Stream:
    tokens: int = 0
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    accepted: float = 0.0  # the request's mean accepted length (0 without speculation)
    error: str = ""
    ids: tuple[int, ...] = ()  # the tokens
    last: float = math.nan  # time.perf_counter() as its last token arrived


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of the values that are numbers; nan when none are."""
    v = sorted(x for x in values if not math.isnan(x))
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))] if v else math.nan


def mode_settings(mode: str, a: argparse.Namespace) -> dict[str, Any]:
    if mode == "off":
        return {"speculation": False}
    if mode == "chains":
        return {"speculation": True, "num_steps": a.chain_steps, "topk": 1}
    if mode == "trees":
        return {"speculation": True, "num_steps": a.tree_steps, "topk": a.tree_topk,
                "num_draft_tokens": a.tree_tokens}
    if mode == "adaptive":  # num_steps unset: the gateway chooses each cycle, trees of this shape included
        return {"topk": a.tree_topk, "num_draft_tokens": a.tree_tokens}
    raise ValueError(f"unknown mode {mode!r} (off, chains, trees, adaptive)")


def captured_while_serving(stack: ServiceStack) -> tuple[int, int]:
    """CUDA graphs the target and the draft have captured after their warm-ups, and the
    milliseconds those captures held their steps up (their Stats)."""
    target, draft = stack.stats()
    count = target.graphs_captured_while_serving + (draft.graphs_captured_while_serving if draft else 0)
    ms = target.graph_capture_ms_while_serving + (draft.graph_capture_ms_while_serving if draft else 0)
    return count, ms


def since(before: tuple[int, int], after: tuple[int, int]) -> tuple[int, int]:
    """The captures (count, ms) between two readings of captured_while_serving."""
    return after[0] - before[0], after[1] - before[1]


def past_graph_budget(stack: ServiceStack) -> int:
    """Steps the target and the draft have run eagerly for want of room for their graphs (their Stats)."""
    target, draft = stack.stats()
    return target.steps_past_graph_budget + (draft.steps_past_graph_budget if draft else 0)


Prompt = str | list[int]


def prompts_for(model: str) -> list[Prompt]:
    """The chat prompts, or for a model without a tokenizer (a shape with random weights) as
    many prompts of 64 fixed token ids."""
    if TextCodec.from_checkpoint(resolve_target_dir(model)) is not None:
        return list(CHAT_PROMPTS)
    vocab = load_target_config(resolve_target_dir(model)).vocab_size
    return token_prompts(vocab, len(CHAT_PROMPTS))


def run(addr: str, n: int, max_new: int, settings: dict[str, Any], prompts: list[Prompt], first: int = 0
        ) -> tuple[list[Stream], float]:
    """N streams at once, stream i on prompt first + i (round robin) -> each stream's figures,
    and the wall seconds from the first call to the last token."""
    streams = [Stream() for _ in range(n)]
    start = threading.Barrier(n + 1)

    def one(i: int) -> None:
        client = GatewayClient(addr)
        seed = {"seed": (first + i) % len(prompts)} if settings.get("temperature") else {}
        prompt = prompts[(first + i) % len(prompts)]
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        req = make_request(text, token_ids=ids, max_new_tokens=max_new, ignore_eos=True,
                           **seed, **settings)
        grpc.channel_ready_future(client.channel).result(timeout=60)  # connected before the clock starts
        start.wait()
        t0 = time.perf_counter()
        try:
            gen = client.generate(req, timeout=3600)
        except Exception as e:  # noqa: BLE001 -- a failed stream is reported, not fatal
            streams[i].error = str(e)[:200]
            return
        finally:
            client.close()
        s = streams[i]
        s.tokens, s.ids = len(gen.token_ids), tuple(gen.token_ids)
        if gen.chunk_times:
            s.ttft_s, s.last = gen.chunk_times[0] - t0, gen.chunk_times[-1]
        if s.tokens > 1:
            s.tpot_s = (gen.chunk_times[-1] - gen.chunk_times[0]) / (s.tokens - 1)
        s.accepted = gen.final.speculation.mean_accepted_length if gen.final is not None else 0.0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    ends = [s.last for s in streams if not math.isnan(s.last)]  # (not the channels' closing)
    return streams, (max(ends) if ends else time.perf_counter()) - t0


def curve_row(common: dict[str, Any], ahead: str, mode: str, n: int,
              rounds: list[tuple[list[Stream], float, tuple[int, int]]], solo: list[tuple[int, ...]],
              tokens_per_s: dict[tuple[str, str, int], float], warm_up_captures: tuple[int, int], past_budget: int,
              settings: dict[str, Any], first_n: int, first_ahead: str) -> dict[str, Any]:
    """One (mode, N)'s line: tokens/s the median of its rounds, the latencies' percentiles over
    every stream of every round."""
    tps = tokens_per_s[ahead, mode, n]
    done = [s for streams, _, _ in rounds for s in streams]
    ok = [s for s in done if not s.error]
    row = {**common, "decode_ahead_ms": ahead or "default", "mode": mode, "streams": n,
           "aggregate_tokens_per_s": round(tps, 2),
           "rounds_tokens_per_s": [round(sum(s.tokens for s in r if not s.error) / wall, 2) for r, wall, _ in rounds],
           "ttft_ms_p50": round(percentile([s.ttft_s for s in ok], 50) * 1e3, 2),
           "ttft_ms_p99": round(percentile([s.ttft_s for s in ok], 99) * 1e3, 2),
           "tpot_ms_p50": round(percentile([s.tpot_s for s in ok], 50) * 1e3, 3),
           "tpot_ms_p99": round(percentile([s.tpot_s for s in ok], 99) * 1e3, 3),
           "over_one_stream": round(tps / tokens_per_s[ahead, mode, first_n], 3),
           "mean_accepted_length": round(sum(s.accepted for s in ok) / max(1, len(ok)), 3),
           "same_tokens_as_solo": round(sum(s.ids == solo[i % len(solo)] for streams, _, _ in rounds
                                            for i, s in enumerate(streams) if not s.error) / max(1, len(ok)), 3),
           "wall_s": round(sum(wall for _, wall, _ in rounds), 3), "errors": [s.error for s in done if s.error][:3],
           "graphs_captured": sum(c for _, _, (c, _) in rounds), "graphs_captured_in_warm_up": warm_up_captures[0],
           "graph_capture_ms": sum(ms for _, _, (_, ms) in rounds), "graph_capture_ms_in_warm_up": warm_up_captures[1],
           "steps_past_graph_budget": past_budget, **settings}
    if mode != "off" and (ahead, "off", n) in tokens_per_s:
        row["over_speculation_off"] = round(tps / tokens_per_s[ahead, "off", n], 3)
    if ahead != first_ahead:
        row["over_first_decode_ahead"] = round(tps / tokens_per_s[first_ahead, mode, n], 3)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--head", default="default", help="EAGLE-3 head (default: the shipped one for --model)")
    p.add_argument("--device", default=None, help="the services' device (default: theirs, the CPU)")
    p.add_argument("--draft-device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--fused-decode", default=None, help="the target's --fused-decode (CUDA)")
    p.add_argument("--hidden-backend", default=None, help="the target's --hidden-backend")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--streams", default="1,2,4,8,16,32,64")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens a stream of each (mode, N)'s warm-up run")
    p.add_argument("--rounds", type=int, default=3, help="measured runs of each (mode, N), the modes interleaved; "
                   "tokens/s is their median")
    p.add_argument("--modes", default="off,trees,adaptive", help="off, chains, trees, adaptive (steps chosen "
                   "per cycle by the gateway)")
    p.add_argument("--chain-steps", type=int, default=3)
    p.add_argument("--tree-steps", type=int, default=5)
    p.add_argument("--tree-topk", type=int, default=4)
    p.add_argument("--tree-tokens", type=int, default=16, help="a tree's size counting the root")
    p.add_argument("--threads", type=int, default=None, help="torch threads of each service (CPU)")
    p.add_argument("--temperature", type=float, default=0.0, help="every request sampled at this temperature "
                   "(each stream seeded by its prompt's index; 0: greedy)")
    p.add_argument("--decode-ahead-ms", default="", help="comma list of the gateway's --decode-ahead-ms, a stack "
                   "each (default: the gateway's own)")
    p.add_argument("--forced-acceptance", default="", help="benchmark mode for heads without trained weights (a "
                   "shape's random head): each verify accepts a number of drafts drawn from this per-depth profile "
                   "('shipped' or rates) and the draft ranks its trees by it (specsplit.forced); every line says so")
    a = p.parse_args()
    forced = ForcedAcceptance.parse(a.forced_acceptance)
    prompts = prompts_for(a.model)
    streams = [int(x) for x in a.streams.split(",")]
    modes = a.modes.split(",")
    aheads = a.decode_ahead_ms.split(",") if a.decode_ahead_ms else [""]
    t_start = time.time()
    common = {"bench": "concurrency", "model": a.model, "head": a.head, "device": a.device or "cpu",
              "draft_device": a.draft_device or a.device or "cpu", "dtype": a.dtype, "fused_decode": a.fused_decode,
              "max_new_tokens": a.max_new_tokens, "warmup_tokens": a.warmup_tokens, "rounds": a.rounds,
              "commit": git_commit(), "machine": platform.machine(),
              **({"acceptance": forced.label_for(trees=any(m in ("trees", "adaptive") for m in modes))}
                 if forced is not None else {})}
    benchmark = ({"gateway": ["--benchmark-forced-acceptance", a.forced_acceptance],
                  "target": ["--benchmark-forced-acceptance"],
                  "draft": ["--benchmark-tree-profile", a.forced_acceptance]} if forced is not None else {})
    tokens_per_s: dict[tuple[str, str, int], float] = {}
    for ahead in aheads:
        cfg = StackConfig.of(model=a.model, head=a.head, device=a.device, draft_device=a.draft_device, dtype=a.dtype,
                             fused_decode=a.fused_decode, hidden_backend=a.hidden_backend, max_context=a.max_context,
                             max_sequences=max(streams), threads=a.threads,
                             extra_gateway_args=[*(["--decode-ahead-ms", ahead] if ahead else []),
                                                 *benchmark.get("gateway", [])],
                             extra_target_args=benchmark.get("target", []),
                             extra_draft_args=benchmark.get("draft", []))
        with ServiceStack(cfg) as stack:
            addr = stack.addr("gateway")
            settings = {mode: mode_settings(mode, a) | ({"temperature": a.temperature} if a.temperature else {})
                        for mode in modes}
            solo = {mode: [run(addr, 1, a.max_new_tokens, settings[mode], prompts, i)[0][0].ids  # each alone (warm too)
                           for i in range(min(max(streams), len(prompts)))] for mode in modes}
            for n in streams:
                warm_up: dict[str, tuple[int, int]] = {}
                for mode in modes:
                    before = captured_while_serving(stack)
                    run(addr, n, a.warmup_tokens, settings[mode], prompts)
                    warm_up[mode] = since(before, captured_while_serving(stack))
                rounds: dict[str, list[tuple[list[Stream], float, tuple[int, int]]]] = {mode: [] for mode in modes}
                for _ in range(a.rounds):  # the modes interleaved, round by round: drift hits them alike
                    for mode in modes:
                        before = captured_while_serving(stack)
                        done, wall = run(addr, n, a.max_new_tokens, settings[mode], prompts)
                        rounds[mode].append((done, wall, since(before, captured_while_serving(stack))))
                for mode in modes:
                    rates = [sum(s.tokens for s in done if not s.error) / wall for done, wall, _ in rounds[mode]]
                    tokens_per_s[ahead, mode, n] = statistics.median(rates)
                for mode in modes:
                    row = curve_row(common, ahead, mode, n, rounds[mode], solo[mode], tokens_per_s, warm_up[mode],
                                    past_graph_budget(stack), settings[mode], streams[0], aheads[0])
                    print(json.dumps(row), flush=True)
    print(json.dumps({**common, "summary": {f"{m}@{n}" + (f"/ahead {h}" if h else ""): round(v, 2)
                                            for (h, m, n), v in tokens_per_s.items()},
                      "wall_s": round(time.time() - t_start, 1)}), flush=True)


if __name__ == "__main__":
    main()
