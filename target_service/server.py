"""gRPC edge of the target service: a thin servicer over TargetRuntime."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from specsplit.observability.spans import record_entry
from specsplit.observability.telemetry import Telemetry
from specsplit.ops import Prefill, StepTiming, TargetOp, TargetResult, Verify
from specsplit.placement import device_identity
from specsplit.transport import columns, wire
from specsplit.transport.lease import Leases
from specsplit.transport.step_stream import Answered, StepAfter, answer_step, serve_steps
from specsplit.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.runtime import TargetRuntime


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, runtime: TargetRuntime, telemetry: Telemetry) -> None:
        self.runtime, self.telemetry = runtime, telemetry
        # one thread: every rank must see the plans in one order
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target-engine")
        self.step_executor = self.executor if runtime.cfg.engine_thread else None
        self.engine_lock = threading.Lock()  # steps come from the gRPC stream and the step socket's threads
        self.leases = Leases("target", self._hold, self._lease_stats)

    async def Describe(self, request: target_pb2.TargetDescribeRequest, context: grpc.aio.ServicerContext
                       ) -> target_pb2.TargetInfo:
        rt, m = self.runtime, self.runtime.model.cfg
        assert rt.writer is not None
        return target_pb2.TargetInfo(
            model_name=m.name, vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
            max_context=rt.cfg.max_context, max_sequences=rt.cfg.max_sequences, eos_token_ids=m.eos_token_ids,
            aux_layer_ids=rt.model.aux_layer_ids, hidden_store=wire.descriptor_to_proto(rt.writer.descriptor),
            tp_size=rt.tp.world_size, dtype=rt.cfg.dtype, max_draft_tokens=rt.cfg.max_draft_tokens,
            step_socket=rt.cfg.step_socket, device=device_identity(rt.cfg.device))

    async def Step(self, request_iterator: AsyncIterator[target_pb2.TargetStepRequest],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[target_pb2.TargetStepResponse]:
        async for reply in serve_steps(request_iterator, context, "target", self.step_executor, self._run,
                                       columns.TARGET_CODEC, self._after):
            yield reply

    def answer(self, request: target_pb2.TargetStepRequest) -> Answered:
        """One step for the step socket, on its connection thread (its spans once the reply is out)."""
        return answer_step(request, "target", self._run, columns.TARGET_CODEC, self._after)

    def _run(self, ops: list[TargetOp], request: target_pb2.TargetStepRequest) -> tuple[list[TargetResult], StepTiming]:
        with self.engine_lock:
            self.leases.check(request.epoch)
            return self.runtime.step(ops, list(request.release_generations))

    @property
    def _after(self) -> StepAfter | None:
        return self._spans if self.telemetry.tracing else None

    def _spans(self, ops: list[TargetOp], results: list[TargetResult]) -> None:
        spans = self.telemetry.spans
        assert spans is not None  # set as the step's `after` only when tracing
        for op, r in zip(ops, results, strict=True):
            if not op.trace:
                continue
            attrs = {"spec.seq_id": op.seq_id, "spec.status": r.code.name, "spec.tokens": len(r.tokens)}
            if isinstance(op, Verify):
                attrs.update({"spec.draft_tokens": len(op.draft_ids), "spec.num_accepted": r.num_accepted})
            elif isinstance(op, Prefill):
                attrs["spec.prompt_tokens"] = len(op.prompt_ids)
            if r.hidden is not None:
                attrs.update({"handoff.offset": r.hidden.offset, "handoff.rows": r.hidden.rows,
                              "handoff.generation": r.hidden.generation})
            name = "target." + type(op).__name__.lower()
            record_entry(spans, name, op.trace, r.started_ns, r.ended_ns, attrs)

    async def Stats(self, request: target_pb2.TargetStatsRequest, context: grpc.aio.ServicerContext
                    ) -> target_pb2.TargetStats:
        return target_pb2.TargetStats(**self.runtime.stats())

    async def Lease(self, request: common_pb2.LeaseRequest, context: grpc.aio.ServicerContext
                    ) -> common_pb2.LeaseReply:
        return await self.leases.answer(request, context)

    def _hold(self, epoch: int) -> int:
        with self.engine_lock:
            return self.runtime.hold(epoch)

    def _lease_stats(self) -> dict[str, int]:
        stats = self.runtime.stats()
        return {"active_sequences": stats["active_sequences"], "ring_rows_in_use": stats["ring_rows_in_use"]}
