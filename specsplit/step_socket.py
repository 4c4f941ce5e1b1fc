"""The Step stream over a Unix socket: the same protobuf requests and replies as the gRPC
Step stream, for a gateway on the same host as the service (where the hidden states
already move through shared GPU memory). A message on an open gRPC aio bidi stream costs
~180 µs on the H200 host, a Unix socket exchange ~14 µs (shared DEVICE.md); each cycle
makes two such calls. The services still serve everything on gRPC (Describe, Attach,
Stats, health, Step); this is an optional second door to Step, advertised in
Describe/Attach, used only when the gateway can open the path.

Framing: the client opens with MAGIC + the service name; then each request is
[u32 length][bytes] and each answer [u8 kind][u32 length][bytes], kind 0 a reply, kind 1 an
error ("STATUS\tmessage", after which the server closes). Lengths are bounded. The socket
file is created owner-only (0600)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from specsplit.serving import MAX_MESSAGE_BYTES

MAGIC = b"specsplit-step/1\n"
_LEN = struct.Struct("<I")
_HEAD = struct.Struct("<BI")  # kind, length
_REPLY, _ERROR = 0, 1
log = logging.getLogger("specsplit")


MAX_PATH_BYTES = 107  # sun_path on Linux, terminator excluded


def check_step_socket(path: str) -> None:
    """Configuration check: "" (off), or a path a Unix socket can be bound at."""
    if not path:
        return
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise ValueError(f"step socket path {path!r} is longer than {MAX_PATH_BYTES} bytes")
    parent = Path(path).parent
    if not parent.is_dir():
        raise ValueError(f"step socket directory {str(parent)!r} does not exist")
    if Path(path).exists() and not Path(path).is_socket():
        raise ValueError(f"step socket path {path!r} exists and is not a socket")


class StepSocketError(ConnectionError):
    """The service ended the socket stream with a status (as a gRPC abort would)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _SocketContext:
    """The one ServicerContext method serve_steps uses."""

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise _Aborted(code, message)


HELLO_TIMEOUT_S = 10.0


def _hello(service: str) -> bytes:
    """What a client sends first: MAGIC, then the service it expects, one line each."""
    return MAGIC + service.encode() + b"\n"


async def _read_hello(reader: asyncio.StreamReader) -> bytes:
    """Two lines: MAGIC, then the service name (each bounded by the reader's line limit)."""
    return await reader.readline() + await reader.readline()


StepHandler = Callable[[AsyncIterator[Any], Any], AsyncIterator[Any]]  # a servicer's Step


async def start_step_socket(path: str | Path, service: str, request_type: type, step: StepHandler
                            ) -> asyncio.AbstractServer:
    """Serve `step` (the servicer's own Step method) on the Unix socket `path`."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError):
        if path.is_socket():
            path.unlink()  # a stale socket of an earlier run
    hello = _hello(service)

    async def requests(reader: asyncio.StreamReader) -> AsyncIterator[Any]:
        while True:
            try:
                (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            except asyncio.IncompleteReadError:
                return  # the gateway closed the stream
            if n > MAX_MESSAGE_BYTES:
                raise _Aborted(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request of {n} bytes over {MAX_MESSAGE_BYTES}")
            try:
                yield request_type.FromString(await reader.readexactly(n))
            except DecodeError:
                raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, "malformed step request") from None

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            got = await asyncio.wait_for(_read_hello(reader), HELLO_TIMEOUT_S)
            if got != hello:
                raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, f"not a {service} step stream")
            async for reply in step(requests(reader), _SocketContext()):
                data = reply.SerializeToString()
                writer.write(_HEAD.pack(_REPLY, len(data)) + data)
                await writer.drain()
        except _Aborted as e:
            msg = f"{e.code.name}\t{e.message}".encode()
            writer.write(_HEAD.pack(_ERROR, len(msg)) + msg)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, TimeoutError):
            pass  # gone, or not speaking the protocol
        finally:
            writer.close()

    server = await asyncio.start_unix_server(on_connection, path=str(path))
    os.chmod(path, 0o600)
    log.info("%s step socket on %s", service, path)
    return server


def close_step_socket(server: asyncio.AbstractServer, path: str | Path) -> None:
    server.close()  # open streams end when their gateway goes or the process exits
    with contextlib.suppress(FileNotFoundError):
        Path(path).unlink()


class SocketStream:
    """One open Step stream over the socket; requests and replies strictly alternate.
    Same `exchange`/`reset` as gateway.clients' gRPC stream."""

    def __init__(self, path: str, service: str, reply_type: type) -> None:
        self.path, self.service, self.reply_type = path, service, reply_type
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def exchange(self, request: Any) -> Any:
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_unix_connection(self.path)
                self.writer.write(_hello(self.service))
            assert self.reader is not None
            data = request.SerializeToString()
            self.writer.write(_LEN.pack(len(data)) + data)
            kind, n = _HEAD.unpack(await self.reader.readexactly(_HEAD.size))
            if n > MAX_MESSAGE_BYTES:
                raise ConnectionError(f"{self.service} step socket: reply of {n} bytes")
            payload = await self.reader.readexactly(n)
        except asyncio.IncompleteReadError:
            self.reset()
            raise ConnectionError(f"{self.service} step socket closed by the service") from None
        except BaseException:
            self.reset()
            raise
        if kind == _ERROR:
            self.reset()
            code, _, message = payload.decode(errors="replace").partition("\t")
            raise StepSocketError(code, message)
        reply = self.reply_type.FromString(payload)
        if reply.step_id != request.step_id:
            self.reset()
            raise ConnectionError(f"reply for step {reply.step_id}, expected {request.step_id}")
        return reply

    def reset(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None
