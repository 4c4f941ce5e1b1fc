"""gRPC edge of the draft service: a thin servicer over DraftRuntime."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from draft_service.runtime import DraftRuntime
from specsplit.observability.spans import record_entry
from specsplit.observability.telemetry import Telemetry
from specsplit.ops import DraftOp, DraftResult, ExtendPropose, StepTiming
from specsplit.placement import device_identity
from specsplit.transport import columns, wire
from specsplit.transport.handoff.base import Descriptor
from specsplit.transport.lease import Leases
from specsplit.transport.step_stream import Answered, StepAfter, answer_step, serve_steps
from specsplit.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger("specsplit.draft")


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, runtime: DraftRuntime, telemetry: Telemetry) -> None:
        self.runtime, self.telemetry = runtime, telemetry
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-engine")
        self.step_executor = self.executor if runtime.cfg.engine_thread else None
        self.engine_lock = threading.Lock()  # steps come from the gRPC stream and the step socket's threads
        self.leases = Leases("draft", self._hold, lambda: {"active_sequences": len(runtime.engine.seqs)})

    def _info(self) -> draft_pb2.DraftInfo:
        rt, c = self.runtime, self.runtime.head.cfg
        return draft_pb2.DraftInfo(head_name=c.name, hidden_size=c.hidden_size, draft_vocab_size=c.draft_vocab_size,
                                   target_vocab_size=c.vocab_size, aux_layer_ids=c.aux_layer_ids or [],
                                   attached=rt.descriptor is not None, max_steps=rt.cfg.max_steps,
                                   max_context=rt.cfg.max_context, max_sequences=rt.cfg.max_sequences,
                                   step_socket=rt.cfg.step_socket, max_topk=rt.cfg.max_topk,
                                   device=device_identity(rt.cfg.device))

    async def Describe(self, request: draft_pb2.DraftDescribeRequest, context: grpc.aio.ServicerContext
                       ) -> draft_pb2.DraftInfo:
        return self._info()

    async def Attach(self, request: common_pb2.HiddenStoreDescriptor, context: grpc.aio.ServicerContext
                     ) -> draft_pb2.DraftInfo:
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.executor, self._attach, wire.descriptor_from_proto(request))
        except (ValueError, FileNotFoundError, KeyError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot attach hidden store: {e}")
        return self._info()

    async def Step(self, request_iterator: AsyncIterator[draft_pb2.DraftStepRequest],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[draft_pb2.DraftStepResponse]:
        async for reply in serve_steps(request_iterator, context, "draft", self.step_executor, self._run,
                                       columns.DRAFT_CODEC, self._after):
            yield reply

    def answer(self, request: draft_pb2.DraftStepRequest) -> Answered:
        """One step for the step socket, on its connection thread (its spans once the reply is out)."""
        return answer_step(request, "draft", self._run, columns.DRAFT_CODEC, self._after)

    def _run(self, ops: list[DraftOp], request: draft_pb2.DraftStepRequest) -> tuple[list[DraftResult], StepTiming]:
        with self.engine_lock:
            self.leases.check(request.epoch)
            return self.runtime.step(ops)

    def _attach(self, desc: Descriptor) -> None:
        with self.engine_lock:
            self.runtime.attach(desc)
        # the graphs are captured after the reply (seconds): steps that come meanwhile wait for the lock
        self.executor.submit(self._warm_graphs)

    def _warm_graphs(self) -> None:
        try:
            with self.engine_lock:
                self.runtime.warm_graphs()
        except Exception:  # noqa: BLE001 - serving goes on: its shapes are captured on first use
            log.exception("the draft's warm-up failed")

    @property
    def _after(self) -> StepAfter | None:
        return self._spans if self.telemetry.tracing else None

    def _spans(self, ops: list[DraftOp], results: list[DraftResult]) -> None:
        spans = self.telemetry.spans
        assert spans is not None  # set as the step's `after` only when tracing
        for op, r in zip(ops, results, strict=True):
            if not op.trace:
                continue
            attrs = {"spec.seq_id": op.seq_id, "spec.status": r.code.name, "spec.draft_tokens": len(r.draft_ids)}
            name = "draft.release"
            if isinstance(op, ExtendPropose):
                name = "draft.extend_propose"
                attrs.update({"spec.num_steps": op.num_steps, "spec.extend_tokens": len(op.tokens),
                              "handoff.offset": op.hidden.offset, "handoff.rows": op.hidden.rows,
                              "handoff.generation": op.hidden.generation})
            record_entry(spans, name, op.trace, r.started_ns, r.ended_ns, attrs)

    async def Stats(self, request: draft_pb2.DraftStatsRequest, context: grpc.aio.ServicerContext
                    ) -> draft_pb2.DraftStats:
        return draft_pb2.DraftStats(**self.runtime.stats())

    async def Lease(self, request: common_pb2.LeaseRequest, context: grpc.aio.ServicerContext
                    ) -> common_pb2.LeaseReply:
        return await self.leases.answer(request, context)

    def _hold(self, epoch: int) -> int:
        with self.engine_lock:
            return self.runtime.hold(epoch)
