"""gRPC edge of the gateway: the public Generate API over the scheduler."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from gateway.config import GatewayConfig
from gateway.detok import IncrementalDetokenizer
from gateway.requests import InvalidRequest, ModelLimits, parse
from gateway.scheduler import Failed, Finished, QueueFull, Scheduler, Unavailable
from specsplit.observability.telemetry import extract
from specsplit.tokenizer import TextCodec
from specsplit.v1 import gateway_pb2, gateway_pb2_grpc


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, cfg: GatewayConfig, scheduler: Scheduler, codec: TextCodec | None, limits: ModelLimits,
                 model_name: str, draft_name: str, tracer: trace.Tracer | None = None) -> None:
        self.cfg, self.scheduler, self.codec, self.limits = cfg, scheduler, codec, limits
        self.tracer = tracer or scheduler.tracer
        self.streams = 0  # Generate calls in progress
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
        incoming = dict(context.invocation_metadata() or ()).get("traceparent", "")
        span = self.tracer.start_span("generate", context=extract(incoming), kind=trace.SpanKind.SERVER,
                                      attributes={"gen_ai.operation.name": "text_completion",
                                                  "gen_ai.request.model": self.model_name})
        seq = None
        self.streams += 1
        try:
            if self.streams > self.cfg.max_streams:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"server busy: more than {self.cfg.max_streams} concurrent streams")
            try:
                req = parse(request, self.codec, self.cfg, self.limits)
            except InvalidRequest as e:
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if self.scheduler.draft is None:  # no usable draft (none configured, or refused at attach)
                req.num_steps = 0
            span.set_attributes({
                "gen_ai.request.max_tokens": req.max_new_tokens, "gen_ai.request.temperature": req.sampling.temperature,
                "gen_ai.request.top_p": req.sampling.top_p, "gen_ai.request.top_k": req.sampling.top_k,
                "gen_ai.usage.input_tokens": len(req.prompt_ids), "spec.num_steps": req.num_steps})
            try:
                seq = self.scheduler.submit(req, span)
            except QueueFull as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {e}")
            except Unavailable as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            detok = IncrementalDetokenizer(self.codec) if self.codec is not None else None
            pending: list[int] = []  # tokens not streamed yet: the first goes at once, then stream_interval at a time
            streamed = False
            while True:
                event = await seq.events.get()
                if isinstance(event, list):
                    pending += event
                    if not streamed or len(pending) >= self.cfg.stream_interval:
                        yield gateway_pb2.GenerateResponse(token_ids=pending, text=detok.push(pending) if detok else "")
                        pending, streamed = [], True
                elif isinstance(event, Failed):
                    span.set_status(trace.Status(trace.StatusCode.ERROR, event.message))
                    await context.abort(event.code, event.message)
                else:
                    if pending:
                        yield gateway_pb2.GenerateResponse(token_ids=pending, text=detok.push(pending) if detok else "")
                    span.set_attributes({"gen_ai.usage.output_tokens": len(seq.generated),
                                         "gen_ai.response.finish_reasons": [event.reason],
                                         "spec.cycles": seq.stats.cycles,
                                         "spec.mean_accepted_length": seq.stats.mean_accepted_length})
                    yield self._final(seq, event, detok)
                    return
        finally:
            self.streams -= 1
            if seq is not None:
                self.scheduler.cancel(seq)  # no-op when finished; releases state on a dropped client
            span.end()

    def _final(self, seq, end: Finished, detok: IncrementalDetokenizer | None) -> gateway_pb2.GenerateResponse:
        st, now = seq.stats, time.perf_counter()
        hist = [st.histogram.get(i, 0) for i in range(max(st.histogram, default=0) + 1)] if st.cycles else []
        spec = gateway_pb2.SpeculationStats(
            enabled=seq.req.num_steps > 0, num_steps=seq.req.num_steps, cycles=st.cycles,
            mean_accepted_length=st.mean_accepted_length, accepted_length_histogram=hist, draft_ms=st.draft_ms,
            verify_ms=st.verify_ms, draft_compute_ms=st.draft_compute_ms, verify_compute_ms=st.verify_compute_ms,
            topk=seq.req.topk if seq.req.num_steps else 0, num_draft_tokens=seq.req.num_draft_tokens)
        final = gateway_pb2.Final(
            finish_reason=end.reason,
            usage=gateway_pb2.Usage(prompt_tokens=len(seq.req.prompt_ids), completion_tokens=len(seq.generated)),
            speculation=spec, elapsed_ms=(now - seq.submitted_at) * 1e3,
            first_token_ms=((st.first_token_at or now) - seq.submitted_at) * 1e3,
            matched_stop_token=end.matched_stop or 0)
        return gateway_pb2.GenerateResponse(text=detok.flush() if detok else "", final=final)
