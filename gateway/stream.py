"""What both Generate handlers (the public API and SGLang's scheduler API) share: admission
(the stream limits, in all and per client, the call's span, submission with its status
codes, release at the end) and the loop that turns a sequence's events into batches of
tokens. Each handler keeps its own request parsing and messages."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from opentelemetry import trace

from gateway.scheduler import Failed, Finished, GenerationRequest, QueueFull, Scheduler, Sequence, Unavailable
from gateway.validation import InvalidRequest
from specsplit.observability.telemetry import extract

LOOPBACK = ("ipv4:127.", "ipv6:[::1]", "unix:")


def client_key(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, for fairness and per-client limits: the bearer token when there is one
    (hashed), else the peer's address; a loopback or Unix peer is told apart by its connection
    (every local process shares the address)."""
    auth = dict(context.invocation_metadata() or ()).get("authorization", "")
    if auth:
        return "token:" + hashlib.sha256(auth.encode()).hexdigest()[:16]
    peer = context.peer() or ""
    if peer.startswith(LOOPBACK):
        return peer
    return peer.rsplit(":", 1)[0]  # the host, without the port


class GenerateCall:
    """One admitted Generate call: its span, and its sequence once submitted."""

    def __init__(self, scheduler: Scheduler, span: trace.Span, context: grpc.aio.ServicerContext,
                 client: str = "") -> None:
        self.scheduler, self.span, self.context, self.client = scheduler, span, context, client
        self.seq: Sequence | None = None
        self.end: Finished | None = None  # how the sequence finished, once it has

    async def fail(self, code: grpc.StatusCode, message: str) -> None:
        """End the call with `code`, the span marked as an error (raises)."""
        self.span.set_status(trace.Status(trace.StatusCode.ERROR, message))
        await self.context.abort(code, message)

    async def parse(self, parse: Callable[[], GenerationRequest]) -> GenerationRequest:
        """The request `parse` makes; an InvalidRequest ends the call with INVALID_ARGUMENT."""
        try:
            return parse()
        except InvalidRequest as e:
            await self.fail(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise  # not reached: abort raises

    async def submit(self, req: GenerationRequest) -> Sequence:
        """Queue the request: speculation off without a usable draft (none configured, or refused
        at attach); a full queue ends the call with RESOURCE_EXHAUSTED, a lost target with UNAVAILABLE."""
        if self.scheduler.draft is None:
            req.num_steps, req.adaptive = 0, False
        req.client = self.client
        self.span.set_attributes({
            "gen_ai.request.max_tokens": req.max_new_tokens, "gen_ai.request.temperature": req.sampling.temperature,
            "gen_ai.request.top_p": req.sampling.top_p, "gen_ai.request.top_k": req.sampling.top_k,
            "gen_ai.usage.input_tokens": len(req.prompt_ids), "spec.num_steps": req.num_steps})
        try:
            self.seq = self.scheduler.submit(req, self.span)
        except QueueFull as e:
            await self.context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {e}")
        except Unavailable as e:
            await self.context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        assert self.seq is not None
        return self.seq

    async def tokens(self, interval: int) -> AsyncIterator[list[int]]:
        """The sequence's new tokens: the first batch at once, later ones gathered to at least
        `interval` tokens, what is left when it finishes (then `finished` says how). A failure
        ends the call with its status."""
        assert self.seq is not None
        pending: list[int] = []
        streamed = False
        while True:
            event = await self.seq.events.get()
            if isinstance(event, list):
                self.scheduler.taken(self.seq, len(event))
                pending += event
                if not streamed or len(pending) >= interval:
                    yield pending
                    pending, streamed = [], True
            elif isinstance(event, Failed):
                await self.fail(event.code, event.message)
            else:
                if pending:
                    yield pending
                self.end = event
                stats = self.seq.stats
                self.span.set_attributes({"gen_ai.usage.output_tokens": len(self.seq.generated),
                                          "gen_ai.response.finish_reasons": [event.reason], "spec.cycles": stats.cycles,
                                          "spec.mean_accepted_length": stats.mean_accepted_length})
                return

    @property
    def finished(self) -> Finished:
        if self.end is None:
            raise RuntimeError("the sequence has not finished")
        return self.end


class Admission:
    """Admits a servicer's Generate calls, at most `max_streams` at a time, and at most
    `max_per_client` of one client."""

    def __init__(self, scheduler: Scheduler, tracer: trace.Tracer, max_streams: int,
                 max_per_client: int | None = None) -> None:
        self.scheduler, self.tracer, self.max_streams = scheduler, tracer, max_streams
        self.max_per_client = max_streams if max_per_client is None else max_per_client
        self.streams = 0  # calls in progress
        self.per_client: Counter[str] = Counter()

    @asynccontextmanager
    async def call(self, context: grpc.aio.ServicerContext, attributes: dict[str, Any]
                   ) -> AsyncIterator[GenerateCall]:
        """One call, its span continuing the caller's trace; beyond the limit it ends with
        RESOURCE_EXHAUSTED. On leaving, its sequence is cancelled (a no-op when finished; it
        releases the state of a dropped client) and its span ends."""
        incoming = dict(context.invocation_metadata() or ()).get("traceparent", "")
        span = self.tracer.start_span("generate", context=extract(incoming), kind=trace.SpanKind.SERVER,
                                      attributes={"gen_ai.operation.name": "text_completion", **attributes})
        client = client_key(context)
        call = GenerateCall(self.scheduler, span, context, client)
        self.streams += 1
        self.per_client[client] += 1
        try:
            if self.streams > self.max_streams:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"server busy: more than {self.max_streams} concurrent streams")
            if self.per_client[client] > self.max_per_client:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"more than {self.max_per_client} concurrent streams from this client")
            yield call
        finally:
            self.streams -= 1
            self.per_client[client] -= 1
            if not self.per_client[client]:
                del self.per_client[client]
            if call.seq is not None:
                self.scheduler.cancel(call.seq)
            span.end()
