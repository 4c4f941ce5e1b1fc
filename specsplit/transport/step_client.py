"""The gateway's side of a step socket (specsplit.transport.step_socket: the framing and the
server): an asyncio stream on its event loop, or, when the speculation loop has a thread of its
own, a blocking socket (BlockingSocketStream). Either sends a step's request and reads its reply
in two halves (`send`, `receive`), so that the caller can do other work, another service's step
included, while the service computes."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
from collections.abc import Callable, Iterator
from typing import Any

from specsplit.transport.serving import MAX_MESSAGE_BYTES
from specsplit.transport.step_socket import _ERROR, _HEAD, _LEN, StepSocketError, _hello, _poller, _spin


def _decode_reply(kind: int, payload: bytes, request: Any, reply_type: type) -> Any:
    """A reply frame to its message; an error frame or a mismatched reply raises (then reset)."""
    if kind == _ERROR:
        code, _, message = payload.decode(errors="replace").partition("\t")
        raise StepSocketError(code, message)
    reply = reply_type.FromString(payload)
    if reply.step_id != request.step_id:
        raise ConnectionError(f"reply for step {reply.step_id}, expected {request.step_id}")
    return reply


def _frame(request: Any, hello: bytes) -> bytes:
    # the hello and the first request in one write: a service that refuses the stream reads the
    # hello, answers with an error frame and closes; a request written after that close would
    # fail with a broken pipe and hide the service's reason
    data = request.SerializeToString()
    return hello + _LEN.pack(len(data)) + data


class SocketStream:
    """One open Step stream over the socket, on the caller's event loop; requests and replies
    strictly alternate. Same `exchange`/`reset` as gateway.clients' gRPC stream."""

    def __init__(self, path: str, service: str, reply_type: type) -> None:
        self.path, self.service, self.reply_type = path, service, reply_type
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def exchange(self, request: Any, timeout: float | None = None,
                       meanwhile: Callable[[], None] | None = None) -> Any:
        """One step; `meanwhile` runs once the request is written, before the reply is read."""
        await self.send(request, timeout)
        if meanwhile is not None:
            meanwhile()
        return await self.receive(request, timeout)

    async def send(self, request: Any, timeout: float | None = None) -> None:
        """The first half of a step: the request written (the connection opened first if need be)."""
        try:
            async with asyncio.timeout(timeout):
                hello = b""
                if self.writer is None:
                    self.reader, self.writer = await asyncio.open_unix_connection(self.path)
                    self.loop, hello = asyncio.get_running_loop(), _hello(self.service)
                self.writer.write(_frame(request, hello))
        except BaseException:
            self.reset()
            raise

    async def receive(self, request: Any, timeout: float | None = None) -> Any:
        """The second half: the reply to `request`."""
        if self.reader is None:
            raise ConnectionError(f"{self.service} step socket reset before its reply")
        try:
            async with asyncio.timeout(timeout):
                kind, n = _HEAD.unpack(await self.reader.readexactly(_HEAD.size))
                if n > MAX_MESSAGE_BYTES:
                    raise ConnectionError(f"{self.service} step socket: reply of {n} bytes")
                return _decode_reply(kind, await self.reader.readexactly(n), request, self.reply_type)
        except asyncio.IncompleteReadError:
            self.reset()
            raise ConnectionError(f"{self.service} step socket closed by the service") from None
        except BaseException:
            self.reset()
            raise

    def reset(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    def interrupt(self) -> None:
        """Close the connection under a step in flight (any thread): the step fails."""
        writer, loop = self.writer, self.loop
        if writer is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(writer.transport.abort)


class BlockingSocketStream:
    """The same stream on a plain blocking socket: `exchange` never suspends, so the calling
    event loop stands still for the whole step. Only for a loop that has nothing else to do
    meanwhile: the gateway's speculation loop on its own thread, where this saves the event
    loop's wake-ups around every step (the GIL is released while the service computes).
    A read that waits longer than `timeout_s` fails the step (TimeoutError)."""

    def __init__(self, path: str, service: str, reply_type: type, timeout_s: float, spin_s: float = 0.0) -> None:
        self.path, self.service, self.reply_type, self.timeout_s = path, service, reply_type, timeout_s
        self.spin_s = spin_s  # poll this long for the reply before blocking (0: block at once)
        self.sock: socket.socket | None = None
        self.poller: select.poll | None = None
        self.head = bytearray(_HEAD.size)

    async def exchange(self, request: Any, timeout: float | None = None,
                       meanwhile: Callable[[], None] | None = None) -> Any:
        return self.exchange_now(request, timeout, meanwhile)

    def exchange_now(self, request: Any, timeout: float | None = None,
                     meanwhile: Callable[[], None] | None = None) -> Any:
        """One step; a read waits at most `timeout` (default: the stream's `timeout_s`);
        `meanwhile` runs once the request is sent, before the reply is read."""
        self.send_now(request, timeout)
        if meanwhile is not None:
            meanwhile()
        return self.receive_now(request, timeout)

    async def send(self, request: Any, timeout: float | None = None) -> None:
        self.send_now(request, timeout)

    async def receive(self, request: Any, timeout: float | None = None) -> Any:
        return self.receive_now(request, timeout)

    def send_now(self, request: Any, timeout: float | None = None) -> None:
        """The first half of a step: the request sent (connecting first if need be)."""
        timeout = self.timeout_s if timeout is None else timeout
        with self._failing(timeout):
            hello = b""
            if self.sock is None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(timeout)
                self.sock.connect(self.path)
                self.poller = _poller(self.sock, self.spin_s)
                hello = _hello(self.service)
            self.sock.settimeout(timeout)
            self.sock.sendall(_frame(request, hello))

    def receive_now(self, request: Any, timeout: float | None = None) -> Any:
        """The second half: the reply to `request`, a read waiting at most `timeout`."""
        timeout = self.timeout_s if timeout is None else timeout
        if self.sock is None:
            raise ConnectionError(f"{self.service} step socket reset before its reply")
        with self._failing(timeout):
            self.sock.settimeout(timeout)
            _spin(self.poller, self.spin_s)
            kind, n = _HEAD.unpack(self._read_into(self.head))
            if n > MAX_MESSAGE_BYTES:
                raise ConnectionError(f"{self.service} step socket: reply of {n} bytes")
            return _decode_reply(kind, self._read_into(bytearray(n)), request, self.reply_type)

    @contextlib.contextmanager
    def _failing(self, timeout: float) -> Iterator[None]:
        """A failed half of a step resets the connection (a timeout says how long it waited)."""
        try:
            yield
        except TimeoutError:
            self.reset()
            raise TimeoutError(f"{self.service} step took longer than {timeout:g} s") from None
        except BaseException:
            self.reset()
            raise

    def _read_into(self, buf: bytearray) -> bytes:
        assert self.sock is not None
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError(f"{self.service} step socket closed by the service")
            got += n
        return bytes(buf)

    def reset(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        self.sock = None

    def interrupt(self) -> None:
        """Shut the socket under a read in flight (any thread): the step fails with ConnectionError."""
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
