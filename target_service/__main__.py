"""python -m target_service: start the target verify service (rank 0 serves gRPC).

With --tp-size N (and no torchrun), ranks 1..N-1 are spawned as processes.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket

import torch
import torch.distributed as dist

from specsplit.observability.telemetry import setup_telemetry
from specsplit.transport.serving import (
    configure_logging,
    exit_with_launcher,
    install_uvloop,
    log,
    new_server,
    serve_until_signal,
    set_serving,
)
from specsplit.transport.step_socket import SERVICE_SPIN_HELP, StepSocketServer, resolve_spin_s
from specsplit.v1 import target_pb2, target_pb2_grpc
from target_service.config import FUSED_DECODE, TargetConfig
from target_service.runtime import TargetRuntime, init_distributed, worker_loop
from target_service.server import TargetServicer


def parse_args(argv: list[str] | None = None) -> TargetConfig:
    d = TargetConfig()
    p = argparse.ArgumentParser(prog="target_service", description=__doc__)
    p.add_argument("--model", default=os.environ.get("SPECSPLIT_MODEL", d.model))
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--device", default=d.device)
    p.add_argument("--tp-size", type=int, default=d.tp_size)
    p.add_argument("--max-context", type=int, default=d.max_context)
    p.add_argument("--max-sequences", type=int, default=d.max_sequences)
    p.add_argument("--max-draft-tokens", type=int, default=d.max_draft_tokens)
    p.add_argument("--aux-layer-ids", default=None, help="comma-separated target layer ids to capture")
    p.add_argument("--draft-config", default=os.environ.get("SPECSPLIT_DRAFT_CONFIG") or None,
                   help="head config.json naming eagle_aux_hidden_state_layer_ids (env SPECSPLIT_DRAFT_CONFIG)")
    p.add_argument("--hidden-backend", default=d.hidden_backend)
    p.add_argument("--ring-rows", type=int, default=d.ring_rows)
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--dist-port", type=int, default=d.dist_port)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--inline-steps", dest="engine_thread", action="store_false",
                   help="run gRPC Step calls on the event loop thread instead of an engine thread (less latency "
                        "per step; health checks wait while a step runs); the step socket always steps on its "
                        "own connection thread")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run verify steps eagerly on CUDA (default: CUDA graphs per shape bucket)")
    p.add_argument("--step-socket", default=os.environ.get("SPECSPLIT_TARGET_STEP_SOCKET", d.step_socket),
                   help="also serve Step on this Unix socket, for a gateway on the same host "
                        "(env SPECSPLIT_TARGET_STEP_SOCKET; default: gRPC only)")
    p.add_argument("--step-socket-spin-us", type=float, default=d.step_socket_spin_us, help=SERVICE_SPIN_HELP)
    p.add_argument("--compile", action="store_true",
                   help="experimental: fuse the kernels of the static verify/decode forward with torch.compile "
                        "(inductor) before the CUDA graphs capture it; compiles on first use of each shape")
    p.add_argument("--fused-decode", choices=FUSED_DECODE, default=d.fused_decode,
                   help="run the steps of a single sequence (batch-1 decodes, and verifies of chains and trees of "
                        "up to 64 tokens) as the fused Triton step, five kernels a layer (CUDA, tp 1); pdl: also "
                        "with programmatic dependent launch (Hopper+)")
    a = p.parse_args(argv)
    aux = [int(x) for x in a.aux_layer_ids.split(",")] if a.aux_layer_ids else None
    return TargetConfig(model=a.model, dtype=a.dtype, device=a.device, tp_size=a.tp_size, max_context=a.max_context,
                        max_sequences=a.max_sequences, max_draft_tokens=a.max_draft_tokens, aux_layer_ids=aux,
                        draft_config=a.draft_config, hidden_backend=a.hidden_backend, ring_rows=a.ring_rows,
                        host=a.host, port=a.port, dist_port=a.dist_port, threads=a.threads,
                        cuda_graphs=a.cuda_graphs, compile=a.compile, fused_decode=a.fused_decode,
                        engine_thread=a.engine_thread, step_socket=a.step_socket,
                        step_socket_spin_us=a.step_socket_spin_us).validate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
