"""gRPC server plumbing shared by the three services: health checking, limits, errors."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
log = logging.getLogger("specsplit")


def new_server(interceptors: list[grpc.aio.ServerInterceptor] | None = None,
               max_receive_bytes: int = MAX_MESSAGE_BYTES) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A server with health checking; a request over `max_receive_bytes` is refused
    (RESOURCE_EXHAUSTED) before it is parsed."""
    server = grpc.aio.server(interceptors=[MalformedRequestInterceptor(), *(interceptors or [])], options=[
        ("grpc.max_receive_message_length", max_receive_bytes),
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


LAUNCHER_PID_ENV = "SPECSPLIT_LAUNCHER_PID"  # set by specsplit.cli.launcher for the services it starts


def exit_with_launcher() -> None:
    """A service started by specsplit.cli.launcher gets SIGTERM when the launching process dies (Linux
    PR_SET_PDEATHSIG). Set here, after exec: a subprocess preexec_fn is unsafe in a launcher with threads
    (gRPC's), where the child can deadlock between fork and exec and block the launcher for ever."""
    value = os.environ.get(LAUNCHER_PID_ENV)
    if not value:
        return
    try:
        launcher = int(value)
    except ValueError:
        raise SystemExit(f"{LAUNCHER_PID_ENV}={value!r} is not a process id (it is set by the launcher)") from None
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the stack's stop() still ends the services
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != launcher:  # the launcher died before prctl took effect
        raise SystemExit("the launcher exited before this service started")


def configure_logging(name: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")


_MALFORMED = object()


INTERNAL_ERROR = "internal error (the server's log has the details)"


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT, not UNKNOWN, when a unary request's bytes do not decode, and
    INTERNAL with no internal detail when a handler fails unexpectedly (the traceback goes to
    the log, never to the client)."""

    async def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001, ANN201
        handler = await continuation(handler_call_details)
        if handler is None or not (handler.unary_unary or handler.unary_stream):
            return handler
        decode, method = handler.request_deserializer, handler_call_details.method
        message = f"malformed request for {method}: not a valid protobuf message"

        def tolerant(data: bytes) -> object:
            try:
                return decode(data)
            except Exception:  # noqa: BLE001 - any decode failure is the client's
                return _MALFORMED

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary(request, context):  # noqa: ANN001, ANN202
                if request is _MALFORMED:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
                try:
                    return await inner_uu(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception:
                    log.exception("%s failed", method)
                    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_ERROR)

            return grpc.unary_unary_rpc_method_handler(unary, tolerant, handler.response_serializer)
        inner_us = handler.unary_stream

        async def streaming(request, context):  # noqa: ANN001, ANN202
            if request is _MALFORMED:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            try:
                async for item in inner_us(request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception:
                log.exception("%s failed", method)
                await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_ERROR)

        return grpc.unary_stream_rpc_method_handler(streaming, tolerant, handler.response_serializer)
