"""Parsing of public Generate requests (specsplit.v1): the prompt in its three forms and the
request's settings, checked by gateway.validation; every problem is an InvalidRequest with a
message fit for the client (mapped to INVALID_ARGUMENT)."""

from __future__ import annotations

import secrets

from gateway.config import GatewayConfig
from gateway.scheduler import GenerationRequest
from gateway.validation import (
    InvalidRequest,
    ModelLimits,
    adaptive,
    check_fits,
    check_prompt_tokens,
    check_stop_count,
    check_stop_ids,
    check_token_ids,
    num_steps,
    sampling,
    tree_shape,
    with_eos,
)
from specsplit.tokenizer import TextCodec
from specsplit.v1 import gateway_pb2

__all__ = ["InvalidRequest", "ModelLimits", "parse", "prompt_ids", "tree_shape"]

SPECULATION = {gateway_pb2.Speculation.DEFAULT: None, gateway_pb2.Speculation.OFF: False,
               gateway_pb2.Speculation.ON: True}  # mode -> speculation forced off or on (None: as requested)


def _fits_context(count: int, limits: ModelLimits) -> None:
    if count >= limits.max_context:
        raise InvalidRequest(f"prompt of {count} tokens does not fit the context window of {limits.max_context}")


def prompt_ids(req: gateway_pb2.GenerateRequest, codec: TextCodec | None, cfg: GatewayConfig,
               limits: ModelLimits) -> list[int]:
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("one of prompt, raw_text or token_ids is required")
    if kind == "token_ids":
        if not req.token_ids.ids:
            raise InvalidRequest("token_ids is empty")
        _fits_context(len(req.token_ids.ids), limits)  # before any copy: a request may hold millions
        ids = list(req.token_ids.ids)
        check_token_ids(ids, limits)
        return ids
    text = req.prompt if kind == "prompt" else req.raw_text
    if not text.strip():
        raise InvalidRequest(f"{kind} is empty")
    if len(text) > cfg.max_prompt_chars:
        raise InvalidRequest(f"{kind} of {len(text)} characters exceeds the limit of {cfg.max_prompt_chars}")
    if codec is None:
        raise InvalidRequest("this model has no tokenizer; send token_ids")
    ids = codec.encode(codec.render_chat(text) if kind == "prompt" else text)
    if not ids:
        raise InvalidRequest(f"{kind} tokenizes to nothing")
    _fits_context(len(ids), limits)
    return ids


def parse(req: gateway_pb2.GenerateRequest, codec: TextCodec | None, cfg: GatewayConfig,
          limits: ModelLimits) -> GenerationRequest:
    max_new = req.max_new_tokens if req.HasField("max_new_tokens") else cfg.default_max_new_tokens
    if max_new <= 0:
        raise InvalidRequest(f"max_new_tokens must be >= 1, got {max_new}")
    if max_new > cfg.max_new_tokens_cap:
        raise InvalidRequest(f"max_new_tokens {max_new} exceeds the cap of {cfg.max_new_tokens_cap}")
    sample = sampling(req.temperature if req.HasField("temperature") else 0.0,
                      req.top_p if req.HasField("top_p") else 1.0, req.top_k if req.HasField("top_k") else 0,
                      req.seed if req.HasField("seed") else secrets.randbits(63))
    stops = set(req.stop_token_ids)
    check_stop_ids(stops, limits)
    check_stop_count(len(stops))
    spec = req.speculation
    if spec.mode not in SPECULATION:
        raise InvalidRequest(f"unknown speculation mode {spec.mode}")
    requested = spec.num_steps if spec.HasField("num_steps") else None
    steps = num_steps(requested, SPECULATION[spec.mode], cfg, limits)
    topk, num_draft_tokens = tree_shape(spec.topk if spec.HasField("topk") else None,
                                        spec.num_draft_tokens if spec.HasField("num_draft_tokens") else None,
                                        cfg, limits, steps, sample.temperature)
    ids = prompt_ids(req, codec, cfg, limits)
    check_prompt_tokens(len(ids), limits)
    check_fits(len(ids), max_new, cfg, limits)
    chosen, min_steps = adaptive(requested, SPECULATION[spec.mode], steps, sample.temperature, cfg)
    return GenerationRequest(ids, max_new, sample, with_eos(stops, limits, req.ignore_eos), steps, topk,
                             num_draft_tokens, adaptive=chosen, min_steps=min_steps)

