"""Validation of public Generate requests: every problem is an InvalidRequest with a
message fit for the client (mapped to INVALID_ARGUMENT)."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.scheduler import GenerationRequest
from specsplit.ops import Sampling
from specsplit.tokenizer import TextCodec
from specsplit.v1 import gateway_pb2


class InvalidRequest(ValueError):
    pass


@dataclass
class ModelLimits:
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]
    draft_available: bool
    max_prompt_tokens: int = 0  # 0: only the context window bounds the prompt
    max_draft_tokens: int = 1 << 30  # the target's limit per verify


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value}")
    return value


def prompt_ids(req: gateway_pb2.GenerateRequest, codec: TextCodec | None, cfg: GatewayConfig,
               limits: ModelLimits) -> list[int]:
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("one of prompt, raw_text or token_ids is required")
    if kind == "token_ids":
        ids = list(req.token_ids.ids)
        if not ids:
            raise InvalidRequest("token_ids is empty")
        if len(ids) >= limits.max_context:
            raise InvalidRequest(f"prompt of {len(ids)} tokens does not fit the context window of {limits.max_context}")
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequest(f"unknown token id {bad[0]} (vocabulary is 0..{limits.vocab_size - 1})")
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
    if len(ids) >= limits.max_context:
        raise InvalidRequest(f"prompt of {len(ids)} tokens does not fit the context window of {limits.max_context}")
    return ids


def parse(req: gateway_pb2.GenerateRequest, codec: TextCodec | None, cfg: GatewayConfig,
          limits: ModelLimits) -> GenerationRequest:
    max_new = req.max_new_tokens if req.HasField("max_new_tokens") else cfg.default_max_new_tokens
    if max_new <= 0:
        raise InvalidRequest(f"max_new_tokens must be >= 1, got {max_new}")
    if max_new > cfg.max_new_tokens_cap:
        raise InvalidRequest(f"max_new_tokens {max_new} exceeds the cap of {cfg.max_new_tokens_cap}")
    temperature = _finite("temperature", req.temperature) if req.HasField("temperature") else 0.0
    if temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0, got {temperature}")
    top_p = _finite("top_p", req.top_p) if req.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    top_k = req.top_k if req.HasField("top_k") else 0
    if top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0, got {top_k}")
    stops = set(req.stop_token_ids)
    bad = [t for t in stops if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(f"unknown stop token id {bad[0]}")
    if len(stops) > 64:
        raise InvalidRequest("at most 64 stop token ids")
    if not req.ignore_eos:
        stops |= set(limits.eos_token_ids)
    spec = req.speculation
    if spec.mode not in (gateway_pb2.Speculation.DEFAULT, gateway_pb2.Speculation.OFF, gateway_pb2.Speculation.ON):
        raise InvalidRequest(f"unknown speculation mode {spec.mode}")
    steps = spec.num_steps if spec.HasField("num_steps") else cfg.default_num_steps
    if not 0 <= steps <= cfg.max_num_steps:
        raise InvalidRequest(f"speculation.num_steps must be within 0..{cfg.max_num_steps}, got {steps}")
    if spec.mode == gateway_pb2.Speculation.OFF:
        steps = 0
    elif spec.mode == gateway_pb2.Speculation.ON and steps == 0:
        steps = cfg.default_num_steps or 1
    if not limits.draft_available:
        steps = 0
    topk, num_draft_tokens = tree_shape(spec.topk if spec.HasField("topk") else None,
                                        spec.num_draft_tokens if spec.HasField("num_draft_tokens") else None,
                                        cfg, limits, steps, temperature)
    ids = prompt_ids(req, codec, cfg, limits)
    if limits.max_prompt_tokens and len(ids) > limits.max_prompt_tokens:
        raise InvalidRequest(f"prompt of {len(ids)} tokens exceeds the limit of {limits.max_prompt_tokens}")
    room = draft_room(cfg)
    if len(ids) + max_new + room > limits.max_context:
        raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) does not fit the context "
                             f"window of {limits.max_context} (with {room} tokens of draft room)")
    seed = req.seed if req.HasField("seed") else secrets.randbits(63)
    return GenerationRequest(ids, max_new, Sampling(temperature, top_p, top_k, seed & (2**63 - 1)), stops, steps,
                             topk, num_draft_tokens)


def draft_room(cfg: GatewayConfig) -> int:
    """Context kept free after a request's last token for one verify's drafts and the root."""
    return max(cfg.max_num_steps, cfg.max_num_draft_tokens - 1) + 1


def tree_shape(topk: int | None, num_draft_tokens: int | None, cfg: GatewayConfig, limits: ModelLimits, steps: int,
               temperature: float) -> tuple[int, int]:
    """(topk, num_draft_tokens) of a request (None: the gateway's default); a chain is (1, steps + 1)."""
    if topk is None:
        topk = cfg.default_topk if temperature == 0 else 1
    if not 1 <= topk <= cfg.max_topk:
        raise InvalidRequest(f"speculation.topk must be within 1..{cfg.max_topk}, got {topk}")
    if topk > 1 and temperature > 0:
        raise InvalidRequest("speculation.topk > 1 (a tree of drafts) needs greedy decoding (temperature 0)")
    if steps == 0 or topk == 1:
        if num_draft_tokens is not None and steps and num_draft_tokens != steps + 1:
            raise InvalidRequest(f"a chain (topk 1) of {steps} steps verifies num_draft_tokens = {steps + 1}, "
                                 f"got {num_draft_tokens}")
        return 1, steps + 1
    most = min(cfg.max_num_draft_tokens, limits.max_draft_tokens + 1, 1 + topk + (steps - 1) * topk * topk)
    n = num_draft_tokens if num_draft_tokens is not None else min(cfg.default_num_draft_tokens, most)
    if not 2 <= n <= most:
        raise InvalidRequest(f"speculation.num_draft_tokens must be within 2..{most} for topk {topk} and "
                             f"{steps} steps, got {n}")
    return topk, n
