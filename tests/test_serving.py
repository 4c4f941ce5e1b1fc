"""The gRPC plumbing every service shares: a request that does not decode is INVALID_ARGUMENT,
and a handler that fails unexpectedly answers INTERNAL without its exception's text."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from specsplit.transport.serving import INTERNAL_ERROR, new_server


def _identity(data: bytes) -> bytes:
    return data


async def _broken_unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise RuntimeError("secret internal detail")


async def _broken_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"one"
    raise KeyError("secret internal detail")


def test_unexpected_failures_are_internal_without_their_text() -> None:
    async def main() -> list[tuple[grpc.StatusCode, str]]:
        server, _ = new_server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {
            "Unary": grpc.unary_unary_rpc_method_handler(_broken_unary, _identity, _identity),
            "Stream": grpc.unary_stream_rpc_method_handler(_broken_stream, _identity, _identity)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            unary = ch.unary_unary("/t.T/Unary", _identity, _identity)
            stream = ch.unary_stream("/t.T/Stream", _identity, _identity)
            for call in (lambda: unary(b"x"), lambda: _drain(stream(b"x"))):
                try:
                    await call()
                except grpc.aio.AioRpcError as e:
                    out.append((e.code(), e.details()))
        await server.stop(0)
        return out

    for code, details in asyncio.run(main()):
        assert code == grpc.StatusCode.INTERNAL and details == INTERNAL_ERROR and "secret" not in details


async def _drain(call: grpc.aio.UnaryStreamCall) -> None:
    async for _ in call:
        pass
