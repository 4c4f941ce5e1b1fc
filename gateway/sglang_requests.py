"""Parsing of SGLang scheduler Generate requests (sglang.grpc.scheduler, as smg sends them):
token ids in, our GenerationRequest out, checked by gateway.validation. Every problem is an
InvalidRequest with a message fit for the client (mapped to INVALID_ARGUMENT); features the
gateway does not have are refused by name rather than ignored."""

from __future__ import annotations

import secrets

from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl

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
    draft_room,
    num_steps,
    sampling,
    tree_shape,
    with_eos,
)
from specsplit.tokenizer import TextCodec

MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16


def _refuse_unsupported(req: sgl.GenerateRequest) -> None:
    p = req.sampling_params
    unsupported = {
        "mm_inputs": req.HasField("mm_inputs") and req.mm_inputs.ByteSize() > 0,
        "input_embeds": len(req.input_embeds) > 0,
        "return_logprob": req.return_logprob or req.top_logprobs_num > 0 or len(req.token_ids_logprob) > 0,
        "return_hidden_states": req.return_hidden_states,
        "disaggregated_params": req.HasField("disaggregated_params"),
        "custom_logit_processor": bool(req.custom_logit_processor),
        "lora_id": bool(req.lora_id),
        "data_parallel_rank other than 0": req.HasField("data_parallel_rank") and req.data_parallel_rank != 0,
        "min_p": p.min_p != 0.0,
        "frequency_penalty": p.frequency_penalty != 0.0,
        "presence_penalty": p.presence_penalty != 0.0,
        "repetition_penalty": p.repetition_penalty not in (0.0, 1.0),
        "min_new_tokens": p.min_new_tokens > 0,
        "logit_bias": len(p.logit_bias) > 0,
        "n > 1": p.n > 1,
        "no_stop_trim": p.no_stop_trim,
        f"constraint {p.WhichOneof('constraint')}": p.WhichOneof("constraint") is not None,
    }
    names = [name for name, present in unsupported.items() if present]
    if names:
        raise InvalidRequest(f"not supported by this worker: {', '.join(names)}")


def stop_ids_of(stops: list[str], codec: TextCodec | None) -> set[int]:
    """Stop strings of exactly one token become stop token ids; longer ones are refused
    (smg matches stop strings itself and does not send them, measured with smg 1.13.0)."""
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings")
    ids: set[int] = set()
    for text in stops:
        encoded = codec.encode(text) if codec is not None and len(text) <= 256 else []
        if len(encoded) != 1:
            raise InvalidRequest(f"stop string {text[:40]!r} is not a single token: match it in the router "
                                 "or send stop_token_ids")
        ids.add(encoded[0])
    return ids


def parse_sglang(req: sgl.GenerateRequest, codec: TextCodec | None, cfg: GatewayConfig,
                 limits: ModelLimits) -> GenerationRequest:
    if not req.request_id or len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters")
    _refuse_unsupported(req)
    if not req.tokenized.input_ids:
        raise InvalidRequest("tokenized.input_ids is empty (this worker takes token ids only)")
    if len(req.tokenized.input_ids) >= limits.max_context:  # before any copy: a request may hold millions
        raise InvalidRequest(f"prompt of {len(req.tokenized.input_ids)} tokens does not fit the context window of "
                             f"{limits.max_context}")
    ids = list(req.tokenized.input_ids)
    check_token_ids(ids, limits)
    check_prompt_tokens(len(ids), limits)
    p = req.sampling_params
    kept = draft_room(cfg)
    room = limits.max_context - len(ids) - kept
    if room < 1:
        raise InvalidRequest(f"prompt of {len(ids)} tokens does not fit the context window of "
                             f"{limits.max_context} (with {kept} tokens of draft room)")
    if p.HasField("max_new_tokens"):
        max_new = p.max_new_tokens
        if not 1 <= max_new <= cfg.max_new_tokens_cap:
            raise InvalidRequest(f"max_new_tokens must be within 1..{cfg.max_new_tokens_cap}, got {max_new}")
        check_fits(len(ids), max_new, cfg, limits)
    else:  # unset: the gateway's default, lowered to what the context has room for
        max_new = min(cfg.default_max_new_tokens, room)
    # top_p 0 is proto3's unset; top_k -1 is SGLang's "off"
    sample = sampling(p.temperature, p.top_p if p.top_p != 0.0 else 1.0, max(p.top_k, 0), secrets.randbits(63))
    if p.top_k < -1:
        raise InvalidRequest(f"top_k must be -1 (off) or >= 0, got {p.top_k}")
    check_stop_count(len(p.stop_token_ids))
    stops = set(p.stop_token_ids) | stop_ids_of(list(p.stop), codec)
    check_stop_ids(stops, limits)
    steps = num_steps(None, None, cfg, limits)  # the gateway's defaults
    topk, num_draft_tokens = tree_shape(None, None, cfg, limits, steps, sample.temperature)
    chosen, min_steps = adaptive(None, None, steps, sample.temperature, cfg)
    return GenerationRequest(ids, max_new, sample, with_eos(stops, limits, p.ignore_eos), steps, topk,
                             num_draft_tokens, adaptive=chosen, min_steps=min_steps)
