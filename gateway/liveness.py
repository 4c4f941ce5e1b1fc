"""The gateway's watch over its services: a lease on each (common.proto LeaseRequest), renewed
every heartbeat on the server's event loop, which no step ever blocks.

The renewal's answer is the service's sign of life: one that does not come within the
liveness timeout marks the service lost, idle or in the middle of a step. Every (re)connection
takes a new epoch, and the service then releases whatever earlier epochs held there: the
sequences of streams that failed, of a gateway that restarted, of a draft that timed out.
Renewals and takeovers of one service go out one at a time, so a renewal never carries a
superseded epoch."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from specsplit.transport.serving import channel_options
from specsplit.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

log = logging.getLogger("specsplit.gateway")
TAKE_TIMEOUT_S = 30.0  # a takeover may wait for a step in progress to end
_last_epoch = 0


def new_epoch() -> int:
    """A nonzero epoch above every earlier one of this process and, by the clock, of earlier gateways."""
    global _last_epoch
    _last_epoch = max(_last_epoch + 1, time.time_ns() // 1000)
    return _last_epoch


class ServiceWatch:
    def __init__(self, service: str, addr: str, liveness_s: float, lease_s: float,
                 on_lost: Callable[[str], None]) -> None:
        """A heartbeat every quarter of `liveness_s`, each answered within the rest of it: a
        service that stops answering is lost at most `liveness_s` after its last answer."""
        self.service, self.on_lost = service, on_lost
        self.interval_s = liveness_s / 4
        self.timeout_s = liveness_s - self.interval_s
        self.lease_ms = max(1, round(lease_s * 1e3))
        self.channel = grpc.aio.insecure_channel(addr, options=channel_options())
        stub: Any = target_pb2_grpc.TargetServiceStub if service == "target" else draft_pb2_grpc.DraftServiceStub
        self.stub = stub(self.channel)
        self.epoch = 0  # held now (0: none: before the first takeover, and once lost)
        self.lock = asyncio.Lock()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"{self.service}-watch")

    async def take(self) -> common_pb2.LeaseReply:
        """Take the service over with a new epoch: what earlier epochs held there is released.
        Raises when the service does not answer."""
        async with self.lock:
            epoch = new_epoch()
            reply = await self.stub.Lease(common_pb2.LeaseRequest(epoch=epoch, lease_ms=self.lease_ms),
                                          timeout=max(self.timeout_s, TAKE_TIMEOUT_S))
            self.epoch = epoch
        if reply.released_sequences:
            log.info("%s: epoch %d took over and released %d sequences of earlier epochs", self.service, epoch,
                     reply.released_sequences)
        return reply

    async def give_up(self) -> None:
        """Release what this gateway holds in the service now (best effort: a lapsed lease does it too)."""
        async with self.lock:
            epoch, self.epoch = self.epoch, 0
            if epoch:
                try:
                    await self.stub.Lease(common_pb2.LeaseRequest(epoch=epoch, lease_ms=0), timeout=self.timeout_s)
                except grpc.RpcError as e:
                    log.info("%s: could not give up the lease (%s): it lapses by itself", self.service, e.code().name)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.channel.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            async with self.lock:
                if not self.epoch:
                    continue  # nothing held: the recovery's turn
                try:
                    await self.stub.Lease(common_pb2.LeaseRequest(epoch=self.epoch, lease_ms=self.lease_ms),
                                          timeout=self.timeout_s)
                    continue
                except grpc.RpcError as e:
                    why = ("no answer to a heartbeat within " f"{self.timeout_s:g} s"
                           if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else f"heartbeat failed: {e.code().name}")
                self.epoch = 0
            log.error("%s lost: %s", self.service, why)
            self.on_lost(why)


class Watches:
    """Both services' watches, on the event loop they were made on; `take` may be awaited from
    another loop (the speculation loop's thread)."""

    def __init__(self, watches: dict[str, ServiceWatch]) -> None:
        self.watches, self.loop = watches, asyncio.get_running_loop()

    def start(self) -> None:
        for w in self.watches.values():
            w.start()

    async def take(self, service: str) -> common_pb2.LeaseReply:
        future = asyncio.run_coroutine_threadsafe(self.watches[service].take(), self.loop)
        return await asyncio.wrap_future(future)

    async def close(self) -> None:
        """Give up every lease, then stop watching (on the watches' own loop)."""
        for w in self.watches.values():
            await w.give_up()
            await w.close()
