"""gRPC edge of the gateway: the public Generate API over the scheduler."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from gateway.config import GatewayConfig
from gateway.costs import Shape
from gateway.detok import IncrementalDetokenizer
from gateway.observe import NOOP_TRACER
from gateway.requests import ModelLimits, parse
from gateway.scheduler import Finished, Scheduler, Sequence
from gateway.stream import Admission
from specsplit.tokenizer import TextCodec
from specsplit.v1 import gateway_pb2, gateway_pb2_grpc


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, cfg: GatewayConfig, scheduler: Scheduler, codec: TextCodec | None, limits: ModelLimits,
                 model_name: str, draft_name: str, tracer: trace.Tracer | None = None) -> None:
        self.cfg, self.scheduler, self.codec, self.limits = cfg, scheduler, codec, limits
        self.admission = Admission(scheduler, tracer or NOOP_TRACER, cfg.max_streams, cfg.max_streams_per_client)
        self.model_name, self.draft_name = model_name, draft_name

    async def GetModelInfo(self, request: gateway_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> gateway_pb2.ModelInfo:
        return gateway_pb2.ModelInfo(model_name=self.model_name, draft_name=self.draft_name,
                                     max_context=self.limits.max_context,
                                     max_new_tokens_cap=self.cfg.max_new_tokens_cap,
                                     default_num_steps=self.cfg.default_num_steps,
                                     max_num_steps=self.cfg.max_num_steps, default_topk=self.cfg.default_topk,
                                     max_topk=self.cfg.max_topk,
                                     default_num_draft_tokens=self.cfg.default_num_draft_tokens,
                                     max_num_draft_tokens=self.cfg.max_num_draft_tokens,
                                     draft_available=self.scheduler.speculating)

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        async with self.admission.call(context, {"gen_ai.request.model": self.model_name}) as call:
            req = await call.parse(lambda: parse(request, self.codec, self.cfg, self.limits))
            seq = await call.submit(req)
            detok = IncrementalDetokenizer(self.codec) if self.codec is not None else None
            async for tokens in call.tokens(self.cfg.stream_interval):
                yield gateway_pb2.GenerateResponse(token_ids=tokens, text=detok.push(tokens) if detok else "")
            yield self._final(seq, call.finished, detok)

    @staticmethod
    def _final(seq: Sequence, end: Finished, detok: IncrementalDetokenizer | None) -> gateway_pb2.GenerateResponse:
        st, now = seq.stats, time.perf_counter()
        hist = [st.histogram.get(i, 0) for i in range(max(st.histogram, default=0) + 1)] if st.cycles else []
        # an adaptive request's most used shape
        shape = st.shapes.most_common(1)[0][0] if seq.req.adaptive and st.shapes else Shape.of(seq.req)
        spec = gateway_pb2.SpeculationStats(
            enabled=seq.req.num_steps > 0, num_steps=shape.steps, cycles=st.cycles,
            mean_accepted_length=st.mean_accepted_length, accepted_length_histogram=hist, draft_ms=st.draft_ms,
            verify_ms=st.verify_ms, draft_compute_ms=st.draft_compute_ms, verify_compute_ms=st.verify_compute_ms,
            draft_service_ms=st.draft_service_ms, verify_service_ms=st.verify_service_ms,
            topk=shape.topk if shape.steps else 0, num_draft_tokens=shape.tokens, adaptive=seq.req.adaptive,
            num_steps_histogram=st.steps_histogram, draft_ahead_hits=st.ahead_hits,
            draft_ahead_misses=st.ahead_misses)
        final = gateway_pb2.Final(
            finish_reason=end.reason,
            usage=gateway_pb2.Usage(prompt_tokens=len(seq.req.prompt_ids), completion_tokens=len(seq.generated)),
            speculation=spec, elapsed_ms=(now - seq.submitted_at) * 1e3,
            first_token_ms=((st.first_token_at or now) - seq.submitted_at) * 1e3,
            matched_stop_token=end.matched_stop or 0)
        return gateway_pb2.GenerateResponse(text=detok.flush() if detok else "", final=final)
