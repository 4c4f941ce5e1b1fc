"""A long prompt beside running streams: how long the running streams stall while it is
prefilled, whole or in parts (the gateway's --prefill-chunk), and what the parts cost its own
time to first token. For each value of --prefill-chunk (a stack each, one after the other):
--running streams (a chat prompt, --running-tokens tokens, speculation off) start; once each
has its first token, one request with a prompt of --prompt-tokens tokens (the chat prompts'
tokens repeated) arrives. One JSON line per value: the running streams' longest wait between
two tokens, their median, the long request's time to first token, and the ratios to the first
value's.

  python -m bench.long_prompt --prompt-tokens 1500 --prefill-chunk 0,256                    (CPU)
  python -m bench.long_prompt --model <GGUF> --device cuda:0 --dtype bfloat16 --max-context 8192 \\
      --prompt-tokens 8000 --prefill-chunk 0,2048
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from typing import Any

from bench.prompts import CHAT_PROMPTS
from bench.spec_vs_baseline import git_commit
from specsplit.checkpoints.target_checkpoint import resolve_target_dir
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.tokenizer import TextCodec


def long_prompt(model: str, n: int) -> list[int]:
    codec = TextCodec.from_checkpoint(resolve_target_dir(model))
    if codec is None:
        raise SystemExit(f"{model}: no tokenizer")
    ids = [t for text in CHAT_PROMPTS for t in codec.encode(text)]
    return (ids * (n // len(ids) + 1))[:n]


def run(addr: str, running: int, running_tokens: int, prompt: list[int]) -> dict[str, Any]:
    """`running` streams, then the long request once each has a token -> the figures."""
    times: list[list[float]] = [[] for _ in range(running)]
    started = threading.Barrier(running + 1)
    errors: list[str] = []

    def stream(i: int) -> None:
        c = GatewayClient(addr)
        first = True

        def on_chunk(_: object) -> None:
            nonlocal first
            times[i].append(time.perf_counter())
            if first:
                first = False
                started.wait()

        try:
            c.generate(make_request(CHAT_PROMPTS[i % len(CHAT_PROMPTS)], max_new_tokens=running_tokens,
                                    ignore_eos=True, speculation=False), on_chunk=on_chunk)
        except Exception as e:  # noqa: BLE001 -- reported
            errors.append(str(e)[:200])
        finally:
            c.close()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(running)]
    for t in threads:
        t.start()
    started.wait()
    c = GatewayClient(addr)
    t0 = time.perf_counter()
    try:
        gen = c.generate(make_request(token_ids=prompt, max_new_tokens=8, ignore_eos=True, speculation=False))
        ttft = gen.chunk_times[0] - t0
    finally:
        c.close()
    for t in threads:
        t.join()
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:], strict=False)]
    return {"running_max_gap_ms": round(max(gaps) * 1e3, 1),
            "running_gap_ms_p50": round(statistics.median(gaps) * 1e3, 2),
            "long_ttft_ms": round(ttft * 1e3, 1), "errors": errors}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default=None, help="the services' device (default: theirs, the CPU)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--fused-decode", default=None, help="the target's --fused-decode (CUDA)")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--running", type=int, default=2, help="running streams")
    p.add_argument("--running-tokens", type=int, default=64)
    p.add_argument("--prefill-chunk", default="0,256", help="comma list of the gateway's --prefill-chunk, a stack each")
    p.add_argument("--threads", type=int, default=None, help="torch threads of each service (CPU)")
    a = p.parse_args()
    prompt = long_prompt(a.model, a.prompt_tokens)
    first: dict[str, Any] | None = None
    for chunk in a.prefill_chunk.split(","):
        cfg = StackConfig.of(model=a.model, device=a.device, dtype=a.dtype, fused_decode=a.fused_decode,
                             max_context=a.max_context, max_sequences=a.running + 1, threads=a.threads,
                             with_draft=False, extra_gateway_args=["--prefill-chunk", chunk])
        with ServiceStack(cfg) as stack:
            addr = stack.addr("gateway")
            run(addr, a.running, 8, prompt[:64])  # warm
            got = run(addr, a.running, a.running_tokens, prompt)
        row: dict[str, Any] = {"bench": "long_prompt", "prefill_chunk": int(chunk), "prompt_tokens": len(prompt),
                               "running": a.running, "running_tokens": a.running_tokens, **got}
        first = first or row
        row["max_gap_vs_first"] = round(row["running_max_gap_ms"] / first["running_max_gap_ms"], 3)
        row["long_ttft_vs_first"] = round(row["long_ttft_ms"] / first["long_ttft_ms"], 3)
        row.update({"model": a.model, "device": a.device or "cpu", "dtype": a.dtype or "float32",
                    "commit": git_commit(), "machine": platform.machine()})
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
