"""Brings lost services back: re-attaches the draft after it failed (or was not there at
start), reconnects to the target after it failed, and keeps grpc.health in step. Every
(re)connection takes the service over with a new epoch (gateway.liveness), so whatever the
lost connection held there is released before the first new step."""

from __future__ import annotations

import asyncio
import logging

from gateway.clients import GrpcDraft, GrpcTarget
from gateway.liveness import Watches
from gateway.scheduler import Scheduler
from specsplit.placement import draft_ahead_on

log = logging.getLogger("specsplit.gateway")


class Recovery:
    def __init__(self, scheduler: Scheduler, target: GrpcTarget, draft: GrpcDraft | None, store: object,
                 target_aux_ids: list[int], max_num_steps: int, retry_s: float, step_sockets: bool = True,
                 max_topk: int = 1, watches: Watches | None = None, draft_ahead: str = "off",
                 target_device: str = "") -> None:
        self.scheduler, self.target, self.draft, self.watches = scheduler, target, draft, watches
        self.store, self.target_aux_ids, self.retry_s = store, target_aux_ids, retry_s
        self.max_num_steps, self.max_topk, self.draft_name = max_num_steps, max_topk, ""
        self.step_sockets = step_sockets  # use a service's Unix step socket when it offers one
        self.draft_ahead, self.target_device = draft_ahead, target_device  # (specsplit.placement)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="service-recovery")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def attach_draft(self) -> bool:
        """Map the target's hidden store in the draft; False when the draft is not usable."""
        if self.draft is None:
            return False
        try:
            info = await self.draft.attach(self.store, timeout=self.retry_s)
        except Exception as e:  # noqa: BLE001 - any failure means: not yet
            log.debug("draft attach failed: %s", e)
            return False
        if info.max_steps < self.max_num_steps:
            log.error("the draft allows %d steps, the gateway's max_num_steps is %d: speculation stays off",
                      info.max_steps, self.max_num_steps)
            self.draft = self.scheduler.draft = None
            return False
        if max(info.max_topk, 1) < self.max_topk:
            log.error("the draft branches at most %d ways, the gateway's max_topk is %d: speculation stays off",
                      max(info.max_topk, 1), self.max_topk)
            self.draft = self.scheduler.draft = None
            return False
        if info.aux_layer_ids and list(info.aux_layer_ids) != self.target_aux_ids:
            log.error("the head was trained on target layers %s but the target captures %s; start the target "
                      "with --draft-config: speculation stays off", list(info.aux_layer_ids), self.target_aux_ids)
            self.draft = self.scheduler.draft = None
            return False
        if self.watches is not None:
            try:
                self.draft.epoch = (await self.watches.take("draft")).epoch
            except Exception as e:  # noqa: BLE001 - not yet
                log.debug("draft lease failed: %s", e)
                return False
        transport = self.draft.use_step_transport(info.step_socket if self.step_sockets else "")  # a new stream
        log.info("draft steps over %s", transport)
        self.scheduler.max_sequences = min(self.scheduler.max_sequences, info.max_sequences)
        self.draft_name = info.head_name
        ahead = draft_ahead_on(self.draft_ahead, self.target_device, info.device)
        if ahead != self.scheduler.limits.draft_ahead:
            log.info("drafting ahead %s (--draft-ahead %s; target on %s, draft on %s)", "on" if ahead else "off",
                     self.draft_ahead, self.target_device or "?", info.device or "?")
        self.scheduler.limits.draft_ahead = ahead
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.retry_s)
            s = self.scheduler
            if s.target_down:
                try:
                    info = await self.target.describe(timeout=self.retry_s)
                    if self.watches is not None:
                        # before any step: the lost connection's state goes
                        self.target.epoch = (await self.watches.take("target")).epoch
                except Exception:  # noqa: BLE001 - still down
                    continue
                self.store = info.hidden_store  # a new process has a new ring
                self.target_device = info.device
                log.info("target steps over %s",
                         self.target.use_step_transport(info.step_socket if self.step_sockets else ""))
                s.draft_failed("the target restarted")
                s.target_restored()
            if s.draft_down and self.draft is not None and await self.attach_draft():
                s.draft_restored()
