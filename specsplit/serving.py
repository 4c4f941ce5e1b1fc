"""gRPC server plumbing shared by the three services: health checking, limits, errors."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
log = logging.getLogger("specsplit")


def new_server() -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


def channel_options() -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


async def set_serving(health_servicer: health.aio.HealthServicer, services: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        await health_servicer.set(name, status)


async def serve_until_signal(server: grpc.aio.Server, on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    if on_stop is not None:
        await on_stop()
    await server.stop(grace=1.0)


def install_uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep running without it
        log.warning("uvloop not available; using the default asyncio loop")


def configure_logging(name: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
