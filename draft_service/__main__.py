"""python -m draft_service: start the EAGLE-3 draft service."""

from __future__ import annotations

import argparse
import asyncio
import os

import torch

from draft_service.config import DraftConfig
from draft_service.runtime import DraftRuntime
from draft_service.server import DraftServicer
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
from specsplit.v1 import draft_pb2, draft_pb2_grpc


def parse_args(argv: list[str] | None = None) -> DraftConfig:
    d = DraftConfig()
    p = argparse.ArgumentParser(prog="draft_service", description=__doc__)
    p.add_argument("--head", default=os.environ.get("SPECSPLIT_HEAD", d.head))
    p.add_argument("--target", default=os.environ.get("SPECSPLIT_MODEL", d.target))
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--device", default=d.device)
    p.add_argument("--max-context", type=int, default=d.max_context)
    p.add_argument("--max-sequences", type=int, default=d.max_sequences)
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--max-topk", type=int, default=d.max_topk, help="widest tree branching proposed")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--inline-steps", dest="engine_thread", action="store_false",
                   help="run gRPC Step calls on the event loop thread instead of an engine thread (less latency "
                        "per step; health checks wait while a step runs); the step socket always steps on its "
                        "own connection thread")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run the head eagerly on CUDA (default: CUDA graphs per shape bucket)")
    p.add_argument("--step-socket", default=os.environ.get("SPECSPLIT_DRAFT_STEP_SOCKET", d.step_socket),
                   help="also serve Step on this Unix socket, for a gateway on the same host "
                        "(env SPECSPLIT_DRAFT_STEP_SOCKET; default: gRPC only)")
    p.add_argument("--step-socket-spin-us", type=float, default=d.step_socket_spin_us, help=SERVICE_SPIN_HELP)
    p.add_argument("--compile", action="store_true",
                   help="experimental: fuse the head's static forward with torch.compile (inductor) before the "
                        "CUDA graphs capture it; compiles on first use of each shape")
    a = p.parse_args(argv)
    return DraftConfig(head=a.head, target=a.target, dtype=a.dtype, device=a.device, max_context=a.max_context,
                       max_sequences=a.max_sequences, max_steps=a.max_steps, max_topk=a.max_topk, host=a.host,
                       port=a.port, threads=a.threads, cuda_graphs=a.cuda_graphs, compile=a.compile,
                       engine_thread=a.engine_thread, step_socket=a.step_socket,
                       step_socket_spin_us=a.step_socket_spin_us).validate()


async def serve(cfg: DraftConfig, runtime: DraftRuntime) -> None:
    server, health = new_server()
    telemetry = setup_telemetry("specsplit-draft")
    servicer = DraftServicer(runtime, telemetry)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    await server.start()
    # the socket exists before health says SERVING: a gateway started on that signal finds it
    sock = (StepSocketServer(cfg.step_socket, "draft", draft_pb2.DraftStepRequest, servicer.answer,
                             resolve_spin_s(cfg.step_socket_spin_us, torch.device(cfg.device).type == "cuda")).start()
            if cfg.step_socket else None)
    await set_serving(health, ["specsplit.v1.DraftService"], True)
    log.info("draft head %s listening on %s:%d", runtime.head.cfg.name, cfg.host, cfg.port)
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
    configure_logging("draft")
    exit_with_launcher()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    runtime = DraftRuntime(cfg)
    install_uvloop()
    asyncio.run(serve(cfg, runtime))


if __name__ == "__main__":
    main()
