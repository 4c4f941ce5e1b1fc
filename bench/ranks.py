"""Run a benchmark's body on N tensor-parallel ranks, one process and one GPU each (cuda:0..N-1),
joined over NCCL as the target service's ranks are. Every rank runs the same steps (the
collectives inside their CUDA graphs pair up); rank 0 prints.

    spawn_ranks(run, 4, args)   # run(args, tp) on ranks 0..3; returns when all have
"""

from __future__ import annotations

import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from specsplit.models.parallel import TensorParallel


def _rank(rank: int, world: int, port: int, device: str, fn: Callable[[Any, TensorParallel], None], args: Any,
          q) -> None:  # noqa: ANN001
    from target_service.runtime import init_distributed

    try:
        tp = init_distributed(rank, world, port, device)
        fn(args, tp)
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
        q.put((rank, None))
    except BaseException:  # noqa: BLE001
        q.put((rank, traceback.format_exc()))


def spawn_ranks(fn: Callable[[Any, TensorParallel], None], world: int, args: Any, device: str = "cuda") -> None:
    """fn(args, tp) in `world` processes (in this one for a single rank), rank r on `device` + r
    (gloo on the CPU); raises with the first failed rank's traceback, the others stopped. fn
    must be importable (a module-level function)."""
    if world == 1:
        fn(args, TensorParallel())
        return
    from specsplit.cli.launcher import free_port

    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, device, fn, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    done: dict[int, str | None] = {}
    try:
        while len(done) < world and not any(done.values()):  # a failed rank: the others may wait forever
            try:
                rank, err = q.get(timeout=5)
            except queue.Empty:
                gone = [r for r, p in enumerate(procs) if not p.is_alive() and r not in done]
                if gone:
                    done[gone[0]] = f"rank {gone[0]} exited with code {procs[gone[0]].exitcode} without a report"
                continue
            done[rank] = err
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    failed = [err for err in done.values() if err]
    if failed:
        raise RuntimeError(f"a rank failed:\n{failed[0]}")
