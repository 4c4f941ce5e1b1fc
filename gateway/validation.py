"""Checks shared by both request parsers (the public Generate API and SGLang's scheduler
API): sampling bounds, stop ids, prompt and context bounds, speculation settings and the
shape of a tree. Every problem is an InvalidRequest with a message fit for the client
(mapped to INVALID_ARGUMENT)."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from gateway.config import GatewayConfig
from specsplit.ops import Sampling

MAX_STOP_TOKEN_IDS = 64
SEED_MASK = 2**63 - 1


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


def finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value}")
    return value


def sampling(temperature: float, top_p: float, top_k: int, seed: int) -> Sampling:
    """Sampling settings within bounds (top_k 0: off)."""
    temperature = finite("temperature", temperature)
    if temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0, got {temperature}")
    top_p = finite("top_p", top_p)
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0, got {top_k}")
    return Sampling(temperature, top_p, top_k, seed & SEED_MASK)


def check_token_ids(ids: Collection[int], limits: ModelLimits) -> None:
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(f"unknown token id {bad[0]} (vocabulary is 0..{limits.vocab_size - 1})")


def check_stop_count(count: int) -> None:
    if count > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop token ids")


def check_stop_ids(stops: Collection[int], limits: ModelLimits) -> None:
    bad = [t for t in stops if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(f"unknown stop token id {bad[0]}")


def with_eos(stops: set[int], limits: ModelLimits, ignore_eos: bool) -> set[int]:
    return stops if ignore_eos else stops | set(limits.eos_token_ids)


def check_prompt_tokens(count: int, limits: ModelLimits) -> None:
    if limits.max_prompt_tokens and count > limits.max_prompt_tokens:
        raise InvalidRequest(f"prompt of {count} tokens exceeds the limit of {limits.max_prompt_tokens}")


def draft_room(cfg: GatewayConfig) -> int:
    """Context kept free after a request's last token for one verify's drafts and the root."""
    return max(cfg.max_num_steps, cfg.max_num_draft_tokens - 1) + 1


def check_fits(prompt_tokens: int, max_new: int, cfg: GatewayConfig, limits: ModelLimits) -> None:
    """The prompt, the new tokens and the draft room within the context window."""
    room = draft_room(cfg)
    if prompt_tokens + max_new + room > limits.max_context:
        raise InvalidRequest(f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new}) does not fit the "
                             f"context window of {limits.max_context} (with {room} tokens of draft room)")


def num_steps(requested: int | None, on: bool | None, cfg: GatewayConfig, limits: ModelLimits) -> int:
    """Draft steps per cycle: `requested` (None: the gateway's default), turned off or on by
    `on` (None: as requested); 0 without a usable draft."""
    steps = cfg.default_num_steps if requested is None else requested
    if not 0 <= steps <= cfg.max_num_steps:
        raise InvalidRequest(f"speculation.num_steps must be within 0..{cfg.max_num_steps}, got {steps}")
    if on is False:
        steps = 0
    elif on is True and steps == 0:
        steps = cfg.default_num_steps or 1
    return steps if limits.draft_available else 0


def adaptive(requested: int | None, on: bool | None, steps: int, temperature: float, cfg: GatewayConfig
             ) -> tuple[bool, int]:
    """(whether the shape is chosen per cycle, the fewest steps a cycle drafts): for a greedy
    request that speculates and leaves num_steps unset, with --adaptive-steps on; a request
    that turned speculation on drafts at least one step."""
    if not cfg.adaptive_steps or requested is not None or steps == 0 or temperature > 0:
        return False, 0
    return True, 1 if on else 0


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
