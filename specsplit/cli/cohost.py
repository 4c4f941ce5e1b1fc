"""python -m specsplit.cli.cohost TARGET_FLAGS -- DRAFT_FLAGS: the target verify service and the
draft service in one process, each on its own port and step socket.

A draft that shares the target's GPU from a process of its own is a second CUDA context on that
GPU, which time-shares it with the target's; through the services each engine's steps take
longer than in one process (docs/benchmarks.md, `bench.end_to_end`). Co-hosted, both engines
share the process's context and the draft reads the target's ring in place, with no IPC
mapping. They stay two services: the gateway steps each over its own socket, and each keeps its
own config, health, leases and spans. Only a target at tensor parallelism 1: this starts no
other ranks.
"""

from __future__ import annotations

import asyncio
import sys

import torch

import draft_service.__main__ as draft_main
import target_service.__main__ as target_main
from draft_service.config import DraftConfig
from draft_service.runtime import DraftRuntime
from specsplit.transport.serving import configure_logging, exit_with_launcher, install_uvloop, stop_on_signals
from target_service.config import TargetConfig
from target_service.runtime import TargetRuntime, init_distributed

USAGE = "usage: python -m specsplit.cli.cohost [target_service flags] -- [draft_service flags]"


def parse_args(argv: list[str]) -> tuple[TargetConfig, DraftConfig]:
    """The two services' configs from their flags, split at `--`; ValueError names what is wrong."""
    if "--" not in argv:
        raise ValueError(f"the draft's flags follow `--` ({USAGE})")
    at = argv.index("--")
    target, draft = target_main.parse_args(argv[:at]), draft_main.parse_args(argv[at + 1 :])
    if target.tp_size != 1:
        raise ValueError(f"a co-hosted target runs at --tp-size 1, not {target.tp_size}")
    return target, draft


async def serve(target_cfg: TargetConfig, target: TargetRuntime, draft_cfg: DraftConfig, draft: DraftRuntime
                ) -> None:
    stop = stop_on_signals()  # one handler for both: SIGTERM stops them together
    await asyncio.gather(target_main.serve(target_cfg, target, stop), draft_main.serve(draft_cfg, draft, stop))


def main(argv: list[str] | None = None) -> None:
    try:
        target_cfg, draft_cfg = parse_args(sys.argv[1:] if argv is None else argv)
    except (ValueError, OSError) as e:  # a bad setting: say which, no traceback
        raise SystemExit(f"cohost: configuration error: {e}") from None
    configure_logging("cohost")
    exit_with_launcher()
    threads = target_cfg.threads or draft_cfg.threads
    if threads:
        torch.set_num_threads(threads)
    target = TargetRuntime(target_cfg, init_distributed(0, 1, target_cfg.dist_port, target_cfg.device))
    draft = DraftRuntime(draft_cfg)
    install_uvloop()
    try:
        asyncio.run(serve(target_cfg, target, draft_cfg, draft))
    finally:
        target.close()


if __name__ == "__main__":
    main()
