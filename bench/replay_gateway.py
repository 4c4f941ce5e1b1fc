"""python -m bench.replay_gateway: the gateway with replayed acceptance, for benchmarks.

Takes the gateway's flags plus --replay-references (a JSON list of token-id lists: prompt +
target-only output) and --replay-accept-rate; the draft still runs for its cost and state,
and its proposals are replaced by the references' continuations (bench.replay)."""

from __future__ import annotations

import argparse
import sys

from bench.replay import LABEL, ReplayDraft, Replayer
from gateway.__main__ import DraftWrap
from gateway.__main__ import main as gateway_main
from gateway.clients import DraftClient


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.replay_gateway", description=__doc__)
    p.add_argument("--replay-references", required=True)
    p.add_argument("--replay-accept-rate", type=float, default=0.8)
    a, rest = p.parse_known_args(argv)
    if not 0.0 <= a.replay_accept_rate <= 1.0:
        raise SystemExit("bench.replay_gateway: --replay-accept-rate must be within [0, 1]")

    def wrap(client: DraftClient, vocab: int) -> DraftClient:
        return ReplayDraft(client, Replayer.from_file(a.replay_references, a.replay_accept_rate, vocab))

    gateway_main(rest, DraftWrap(wrap, f"{LABEL} {a.replay_accept_rate:.2f}"))


if __name__ == "__main__":
    main(sys.argv[1:])
