"""Why bench.cycle_overhead's 5-step replayed acceptance differed between its two modes before
the replayer drew per (reference, position): a replay of the old replayer's draws alone. It
took every decision from one random stream (seed 0); in process each num_steps got a fresh
replayer and the warm-ups ran the real draft, through the services one replayer served the
warm-ups (prompt 0 at each num_steps) and then the timed runs. A cycle accepts drafts while
their draws are below the rate (and the sequence has room); it always consumes num_steps
draws. One JSON line: τ per mode and num_steps.

  python -m bench.replay_draws
"""

from __future__ import annotations

import argparse
import json
import platform
import random

from bench.spec_vs_baseline import git_commit


def cycles(rng: random.Random, steps: int, max_new: int, rate: float) -> int:
    """Cycles to generate max_new tokens (the first comes from the prefill)."""
    generated, n = 1, 0
    while generated < max_new:
        draws = [rng.random() for _ in range(steps)]
        accepted = 0
        while accepted < steps and generated + accepted < max_new and draws[accepted] < rate:
            accepted += 1
        generated, n = generated + accepted + 1, n + 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-steps", default="3,5")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--accept-rate", type=float, default=0.8)
    a = p.parse_args()
    steps_list = [int(x) for x in a.num_steps.split(",")]
    tokens = a.prompts * (a.max_new_tokens - 1)
    out: dict[str, dict[int, float]] = {"in_process": {}, "services": {}}
    for steps in steps_list:  # in process: a fresh replayer per num_steps, no replayed warm-up
        rng = random.Random(0)
        out["in_process"][steps] = round(tokens / sum(cycles(rng, steps, a.max_new_tokens, a.accept_rate)
                                                      for _ in range(a.prompts)), 3)
    rng = random.Random(0)  # through the services: one replayer, warm-ups first
    for steps in steps_list:
        cycles(rng, steps, a.max_new_tokens, a.accept_rate)
    for steps in steps_list:
        out["services"][steps] = round(tokens / sum(cycles(rng, steps, a.max_new_tokens, a.accept_rate)
                                                    for _ in range(a.prompts)), 3)
    print(json.dumps({"bench": "replay_draws", "tau": out, "accept_rate": a.accept_rate, "prompts": a.prompts,
                      "max_new_tokens": a.max_new_tokens, "note": "the replayer before 4273a90",
                      "commit": git_commit(), "machine": platform.machine()}))


if __name__ == "__main__":
    main()
