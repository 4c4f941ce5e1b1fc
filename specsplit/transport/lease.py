"""The service side of a gateway's lease (common.proto LeaseRequest): which epoch holds the
service's state, and when that hold lapses.

A renewal of the held epoch only moves the deadline: it is answered at once, without waiting
for a step, so that it also tells the gateway the service is alive. Another epoch takes over
(the state of the others is released first), a zero lease gives the state up, and a lapsed
lease releases it from the watch thread."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import grpc

from specsplit.transport.step_stream import StepAbort
from specsplit.v1 import common_pb2

log = logging.getLogger("specsplit.lease")
WATCH_INTERVAL_S = 0.1


class Leases:
    def __init__(self, service: str, hold: Callable[[int], int], stats: Callable[[], dict[str, int]]) -> None:
        """hold(epoch) makes the engine serve `epoch` (0: none), releasing the state of every
        other, and returns how many sequences it released; it may wait for a step to end.
        stats() gives the LeaseReply's counts (active_sequences, ring_rows_in_use)."""
        self.service, self._hold, self._stats = service, hold, stats
        self.epoch = 0
        self.deadline = float("inf")
        self.lock = threading.Lock()  # one change at a time, and the watch thread against them
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name=f"{service}-lease", daemon=True)
        self.thread.start()

    async def answer(self, request: common_pb2.LeaseRequest, context: grpc.aio.ServicerContext
                     ) -> common_pb2.LeaseReply:
        """The Lease RPC of a servicer."""
        if request.epoch == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a lease needs a nonzero epoch")
        released = 0
        if not self.renew(request.epoch, request.lease_ms):  # a change: may wait for a step to end
            released = await asyncio.to_thread(self.change, request.epoch, request.lease_ms)
        return common_pb2.LeaseReply(epoch=self.epoch, released_sequences=released, **self._stats())

    def check(self, epoch: int) -> None:
        """Only the holder steps: a step of a lost connection, late, must not open sequences."""
        if epoch != self.epoch:
            raise StepAbort(grpc.StatusCode.FAILED_PRECONDITION, f"a step of epoch {epoch}, but the {self.service} "
                            f"serves epoch {self.epoch}")

    def renew(self, epoch: int, lease_ms: int) -> bool:
        """A renewal of the held epoch: True when done (the deadline moved); False when the
        request changes the holder (then call `change`, on a thread that may wait)."""
        if epoch != self.epoch or lease_ms == 0:
            return False
        self.deadline = time.monotonic() + lease_ms / 1e3
        return True

    def change(self, epoch: int, lease_ms: int) -> int:
        """`epoch` takes the service over (or, with a zero lease, gives it up); returns the
        sequences released."""
        with self.lock:
            if lease_ms == 0:
                if epoch != self.epoch:
                    return 0  # not the holder: nothing of its is held
                released = self._hold(0)
                self.epoch, self.deadline = 0, float("inf")
                log.info("%s: epoch %d gave up its lease: %d sequences released", self.service, epoch, released)
                return released
            released = self._hold(epoch) if epoch != self.epoch else 0
            if released:
                log.warning("%s: epoch %d took over: %d sequences of earlier epochs released", self.service, epoch,
                            released)
            self.epoch, self.deadline = epoch, time.monotonic() + lease_ms / 1e3
            return released

    def close(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(WATCH_INTERVAL_S):
            if time.monotonic() <= self.deadline:
                continue
            with self.lock:
                if self.epoch == 0 or time.monotonic() <= self.deadline:
                    continue
                epoch = self.epoch
                try:
                    released = self._hold(0)
                except Exception:  # noqa: BLE001 - the watch goes on; the next lapse retries
                    log.exception("%s: releasing the lapsed epoch %d failed", self.service, epoch)
                    continue
                self.epoch, self.deadline = 0, float("inf")
            log.warning("%s: the lease of epoch %d lapsed: %d sequences released", self.service, epoch, released)
