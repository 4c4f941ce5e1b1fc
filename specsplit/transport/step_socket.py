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
file is created owner-only (0600).

The server side is plain threads (one per open stream, at most MAX_CONNECTIONS): the thread
that reads a request runs the engine step and writes the reply, so a step crosses no event
loop and no thread hand-off. The gateway's side: specsplit.transport.step_client."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import grpc
from google.protobuf.message import DecodeError

from specsplit.transport.serving import MAX_MESSAGE_BYTES
from specsplit.transport.step_stream import Answered, StepAbort, finish, stamp_total

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


def _poller(sock: socket.socket, spin_s: float) -> select.poll | None:
    if spin_s <= 0:
        return None
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return poller


def _spin(poller: select.poll | None, spin_s: float) -> None:
    """Poll for up to spin_s before the caller's blocking read: a thread that keeps its CPU
    takes the peer's message without being woken from idle (bench/socket_wakeup.py)."""
    if poller is None:
        return
    deadline = time.perf_counter() + spin_s
    while not poller.poll(0) and time.perf_counter() < deadline:
        pass


MAX_SPIN_US = 1_000_000.0
AUTO_SPIN = -1.0  # a spin setting's default: AUTO_SPIN_US on GPU stacks, 0 on CPU ones
AUTO_SPIN_US = 20_000.0  # longer than a cycle's other step, so a serving stack never blocks between cycles


def check_spin_us(spin_us: float) -> None:
    """Configuration check of a spin before blocking reads, in µs (-1: automatic)."""
    if spin_us != AUTO_SPIN and not 0.0 <= spin_us <= MAX_SPIN_US:
        raise ValueError(f"spin of {spin_us} µs is outside 0..{MAX_SPIN_US:.0f} (or -1: automatic)")


def resolve_spin_s(spin_us: float, on_gpu: bool) -> float:
    """A spin setting in seconds: automatic spins on GPU stacks, whose steps take milliseconds
    and whose hosts pay a wake-up from idle per message (bench/socket_wakeup.py; a core per
    spinning thread while serving), and not on CPU stacks, whose cores compute."""
    if spin_us == AUTO_SPIN:
        spin_us = AUTO_SPIN_US if on_gpu else 0.0
    return spin_us * 1e-6


class StepSocketError(ConnectionError):
    """The service ended the socket stream with a status (as a gRPC abort would)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


HELLO_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 16  # gateways stepping one service at once; more are refused


def _hello(service: str) -> bytes:
    """What a client sends first: MAGIC, then the service it expects, one line each."""
    return MAGIC + service.encode() + b"\n"


StepAnswer = Callable[[Any], Answered]  # request -> (reply, after it is sent) on the calling thread; raises StepAbort


class StepSocketServer:
    """Serves Step on a Unix socket from plain threads: each connection's thread reads a
    request, runs the engine itself (`answer`, which serialises engine access with the
    servicer's other callers) and writes the reply. No event loop and no hand-off between
    threads on the hot path: a blocking read wakes the thread that computes."""

    def __init__(self, path: str | Path, service: str, request_type: type, answer: StepAnswer,
                 spin_s: float = 0.0) -> None:
        self.path, self.service, self.request_type, self.answer = Path(path), service, request_type, answer
        self.spin_s = spin_s  # poll this long for the next request before blocking (0: block at once)
        self.hello = _hello(service)
        self.listener: socket.socket | None = None
        self.connections: set[socket.socket] = set()  # open, hello pending or streaming
        self.streams = 0  # connections past their hello
        self.lock = threading.Lock()

    def start(self) -> StepSocketServer:
        with contextlib.suppress(FileNotFoundError):
            if self.path.is_socket():
                self.path.unlink()  # a stale socket of an earlier run
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        os.chmod(self.path, 0o600)  # owner-only (the launcher's directory is private as well)
        listener.listen(MAX_CONNECTIONS)
        self.listener = listener
        threading.Thread(target=self._accept, name=f"{self.service}-step-socket", daemon=True).start()
        log.info("%s step socket on %s", self.service, self.path)
        return self

    def close(self) -> None:
        """Stop accepting, end open streams (their gateways see the socket close), remove the file."""
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.shutdown(socket.SHUT_RDWR)
            self.listener.close()
            self.listener = None
        with self.lock:
            for conn in self.connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _accept(self) -> None:
        while self.listener is not None:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            with self.lock:
                full = len(self.connections) >= 2 * MAX_CONNECTIONS  # streams, and as many hellos pending
                if not full:
                    self.connections.add(conn)
            if full:
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name=f"{self.service}-step-stream",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        counted = False
        try:
            with conn, conn.makefile("rb") as stream:
                try:
                    counted = self._hello(conn, stream)
                    self._steps(conn, stream)
                except StepAbort as e:
                    _send_error(conn, e.code, e.message)
                except (OSError, ValueError):
                    raise
                except Exception as e:  # a bug of ours: in the log; the stream ends with a status, not a hang
                    log.exception("%s step socket failed", self.service)
                    _send_error(conn, grpc.StatusCode.INTERNAL, f"{self.service} step socket failed: "
                                f"{type(e).__name__}")
        except (OSError, ValueError):
            pass  # gone, timed out, or closed under us
        finally:
            with self.lock:
                self.connections.discard(conn)
                self.streams -= counted

    def _hello(self, conn: socket.socket, stream: BinaryIO) -> bool:
        """Check the opening lines and take a stream slot; True once counted."""
        conn.settimeout(HELLO_TIMEOUT_S)
        if stream.readline(256) + stream.readline(256) != self.hello:
            raise StepAbort(grpc.StatusCode.INVALID_ARGUMENT, f"not a {self.service} step stream")
        conn.settimeout(None)
        with self.lock:
            if self.streams >= MAX_CONNECTIONS:
                raise StepAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.service} serves at most "
                                f"{MAX_CONNECTIONS} step streams at once")
            self.streams += 1
        return True

    def _steps(self, conn: socket.socket, stream: BinaryIO) -> None:
        poller = _poller(conn, self.spin_s)
        while True:
            _spin(poller, self.spin_s)  # requests and replies alternate: nothing is buffered here
            head = stream.read(_LEN.size)
            if len(head) < _LEN.size:
                return  # the gateway closed the stream
            (n,) = _LEN.unpack(head)
            if n > MAX_MESSAGE_BYTES:
                raise StepAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request of {n} bytes over {MAX_MESSAGE_BYTES}")
            data = stream.read(n)
            if len(data) < n:
                return
            received = time.perf_counter()
            try:
                request = self.request_type.FromString(data)
            except DecodeError:
                raise StepAbort(grpc.StatusCode.INVALID_ARGUMENT, "malformed step request") from None
            response, done = self.answer(request)
            stamp_total(response, received)
            reply = response.SerializeToString()
            conn.sendall(_HEAD.pack(_REPLY, len(reply)) + reply)
            finish(done, self.service)  # while the gateway goes on with the reply


def _send_error(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
    msg = f"{code.name}\t{message}".encode()
    with contextlib.suppress(OSError):
        conn.sendall(_HEAD.pack(_ERROR, len(msg)) + msg)
