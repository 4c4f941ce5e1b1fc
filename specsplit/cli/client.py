"""A small client of the gateway's public API (used by the CLI, benchmarks and tests)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from specsplit.transport.serving import channel_options
from specsplit.v1 import gateway_pb2, gateway_pb2_grpc


def make_request(prompt: str | None = None, token_ids: list[int] | None = None, raw: bool = False,
                 max_new_tokens: int | None = None, num_steps: int | None = None, speculation: bool | None = None,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 seed: int | None = None, stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
                 topk: int | None = None, num_draft_tokens: int | None = None) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos)
    if token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    elif raw:
        req.raw_text = prompt or ""
    else:
        req.prompt = prompt or ""
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(req, name, value)
    if speculation is not None:
        req.speculation.mode = gateway_pb2.Speculation.ON if speculation else gateway_pb2.Speculation.OFF
    if num_steps is not None:
        req.speculation.num_steps = num_steps
    if topk is not None:
        req.speculation.topk = topk
    if num_draft_tokens is not None:
        req.speculation.num_draft_tokens = num_draft_tokens
    return req


@dataclass
class Generation:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    final: Any = None
    chunk_times: list[float] = field(default_factory=list)  # time.perf_counter() as each token chunk arrived

    @property
    def tokens_per_s(self) -> float:
        ms = self.final.elapsed_ms if self.final is not None else 0.0
        return len(self.token_ids) / (ms / 1e3) if ms > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        f = self.final
        s = f.speculation
        return {
            "text": self.text, "token_ids": self.token_ids, "finish_reason": f.finish_reason,
            "prompt_tokens": f.usage.prompt_tokens, "completion_tokens": f.usage.completion_tokens,
            "tokens_per_s": round(self.tokens_per_s, 3), "elapsed_ms": round(f.elapsed_ms, 3),
            "first_token_ms": round(f.first_token_ms, 3), "speculation": s.enabled, "num_steps": s.num_steps,
            "topk": s.topk, "num_draft_tokens": s.num_draft_tokens, "adaptive": s.adaptive,
            "num_steps_histogram": list(s.num_steps_histogram),
            "cycles": s.cycles, "mean_accepted_length": round(s.mean_accepted_length, 4),
            "accepted_length_histogram": list(s.accepted_length_histogram),
            "draft_ms": round(s.draft_ms, 3), "verify_ms": round(s.verify_ms, 3),
            "draft_compute_ms": round(s.draft_compute_ms, 3), "verify_compute_ms": round(s.verify_compute_ms, 3),
            "draft_ahead_hits": s.draft_ahead_hits, "draft_ahead_misses": s.draft_ahead_misses,
        }


class GatewayClient:
    def __init__(self, addr: str, token: str | None = None, tls_ca: bytes | None = None,
                 tls_server_name: str | None = None) -> None:
        """tls_ca: PEM roots to trust (TLS on); token: sent as 'authorization: Bearer <token>'.
        Each client has a connection of its own (the gateway tells clients apart by it)."""
        options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if tls_ca is not None:
            self.channel = grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates=tls_ca), options)
        else:
            self.channel = grpc.insecure_channel(addr, options=options)
        self.metadata = [("authorization", f"Bearer {token}")] if token else None
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def call(self, req: gateway_pb2.GenerateRequest, timeout: float | None = None) -> Any:
        """The raw streaming call (cancellable)."""
        return self.stub.Generate(req, timeout=timeout, metadata=self.metadata)

    def stream(self, req: gateway_pb2.GenerateRequest, timeout: float | None = None
               ) -> Iterator[gateway_pb2.GenerateResponse]:
        yield from self.call(req, timeout)

    def generate(self, req: gateway_pb2.GenerateRequest, timeout: float | None = None,
                 on_chunk: Callable[[gateway_pb2.GenerateResponse], None] | None = None) -> Generation:
        out = Generation()
        for msg in self.stream(req, timeout):
            if msg.token_ids:
                out.chunk_times.append(time.perf_counter())
            out.token_ids.extend(msg.token_ids)
            out.text += msg.text
            if on_chunk is not None:
                on_chunk(msg)
            if msg.HasField("final"):
                out.final = msg.final
        return out

    def model_info(self) -> gateway_pb2.ModelInfo:
        return self.stub.GetModelInfo(gateway_pb2.ModelInfoRequest(), timeout=10, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()
