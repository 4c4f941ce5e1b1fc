"""python -m target_service: start the target verify service (rank 0 serves gRPC).

With --tp-size N (and no torchrun), ranks 1..N-1 are spawned as processes.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os

import torch
import torch.distributed as dist

from specsplit.flags import config_parser, from_args
from specsplit.observability.telemetry import setup_telemetry
from specsplit.ports import free_port
from specsplit.transport.serving import (
    configure_logging,
    exit_with_launcher,
    install_uvloop,
    log,
    new_server,
    serve_until_signal,
    set_serving,
)
from specsplit.transport.step_socket import StepSocketServer, resolve_spin_s
from specsplit.v1 import target_pb2, target_pb2_grpc
from target_service.config import TargetConfig
from target_service.runtime import TargetRuntime, init_distributed, worker_loop
from target_service.server import TargetServicer


def build_parser() -> argparse.ArgumentParser:
    return config_parser(TargetConfig, prog="target_service", description=__doc__)


def parse_args(argv: list[str] | None = None) -> TargetConfig:
    return from_args(TargetConfig, build_parser().parse_args(argv)).validate()


async def serve(cfg: TargetConfig, runtime: TargetRuntime) -> None:
    server, health = new_server()
    telemetry = setup_telemetry("specsplit-target")
    servicer = TargetServicer(runtime, telemetry)
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    await server.start()
    # the socket exists before health says SERVING: a gateway started on that signal finds it
    sock = (StepSocketServer(cfg.step_socket, "target", target_pb2.TargetStepRequest, servicer.answer,
                             resolve_spin_s(cfg.step_socket_spin_us, torch.device(cfg.device).type == "cuda")).start()
            if cfg.step_socket else None)
    await set_serving(health, ["specsplit.v1.TargetService"], True)
    log.info("target %s tp=%d listening on %s:%d", runtime.model.cfg.name, cfg.tp_size, cfg.host, cfg.port)
    try:
        await serve_until_signal(server)
    finally:
        if sock is not None:
            sock.close()
        servicer.leases.close()
        telemetry.shutdown()


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = parse_args(argv)
    except (ValueError, OSError) as e:  # a bad setting: say which, no traceback
        raise SystemExit(f"{__package__}: configuration error: {e}") from None
    configure_logging("target")
    exit_with_launcher()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    rank = int(os.environ.get("RANK", "0")) if under_torchrun else 0
    if under_torchrun:
        cfg.tp_size = int(os.environ["WORLD_SIZE"])
    if rank > 0:
        worker_loop(cfg, rank)
        return
    workers = []
    if cfg.tp_size > 1 and not under_torchrun:
        cfg.dist_port = cfg.dist_port or free_port()
        ctx = mp.get_context("spawn")
        workers = [ctx.Process(target=worker_loop, args=(cfg, r), daemon=True) for r in range(1, cfg.tp_size)]
        for w in workers:
            w.start()
    tp = init_distributed(0, cfg.tp_size, cfg.dist_port, cfg.device)
    runtime = TargetRuntime(cfg, tp)
    if tp.world_size > 1:
        dist.barrier()
    install_uvloop()
    try:
        asyncio.run(serve(cfg, runtime))
    finally:
        runtime.close()
        for w in workers:
            w.join(timeout=10)
        if tp.world_size > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
