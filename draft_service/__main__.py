"""python -m draft_service: start the EAGLE-3 draft service."""

from __future__ import annotations

import argparse
import asyncio

import torch

from draft_service.config import DraftConfig
from draft_service.runtime import DraftRuntime
from draft_service.server import DraftServicer
from specsplit.flags import config_parser, from_args
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
from specsplit.transport.step_socket import StepSocketServer, resolve_spin_s
from specsplit.v1 import draft_pb2, draft_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    return config_parser(DraftConfig, prog="draft_service", description=__doc__)


def parse_args(argv: list[str] | None = None) -> DraftConfig:
    return from_args(DraftConfig, build_parser().parse_args(argv)).validate()


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
    log.info("draft head %s listening on %s:%d; its cycles run %s", runtime.head.cfg.name, cfg.host, cfg.port,
             runtime.engine.step_path)
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
    configure_logging("draft")
    exit_with_launcher()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    runtime = DraftRuntime(cfg)
    install_uvloop()
    asyncio.run(serve(cfg, runtime))


if __name__ == "__main__":
    main()
