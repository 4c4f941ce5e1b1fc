"""Prompts written by the target itself (pre-query sampling, as in Magpie): the chat template
up to where the user's words begin is fed to the model, which then writes a user request at
a sampling temperature. The requests are as varied as the model's own chat data, with no
outside dataset; the target then answers them greedily like every other prompt."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from specsplit.tokenizer import TextCodec
from specsplit.training.distill import GenStats, generate_all
from specsplit.training.target import BatchedTarget

_MARKER = "\u2063SPECSPLIT_USER_TEXT\u2063"  # never produced by a template


def pre_query_prefix(codec: TextCodec) -> str:
    """The rendered chat up to the first character of the user's message."""
    rendered = codec.render_chat(_MARKER)
    at = rendered.find(_MARKER)
    if at <= 0:
        raise ValueError("the chat template does not place the user's text after a prefix: no pre-query prompts")
    return rendered[:at]


def clean(text: str, min_words: int = 3, max_chars: int = 1500) -> str | None:
    """A usable request, or None: special tokens cut, whitespace trimmed, too short or too long dropped."""
    text = re.split(r"<\|[^|>]*\|>|</s>", text, maxsplit=1)[0].strip()
    if len(text.split()) < min_words or len(text) > max_chars:
        return None
    return text


def synthesize(target: BatchedTarget, codec: TextCodec, count: int, max_tokens: int, batch_size: int,
               temperature: float, seed: int, deadline: float | None,
               on_batch: Callable[[int, int, GenStats], None] | None = None) -> tuple[list[str], GenStats]:
    """Up to `count` distinct requests (fewer after cleaning and de-duplication)."""
    prefix = codec.encode(pre_query_prefix(codec))
    with torch.no_grad():
        samples, stats = generate_all(target, [prefix] * count, max_tokens, batch_size, target.cfg.eos_token_ids,
                                      temperature, seed, deadline, on_batch)
    seen: set[str] = set()
    out: list[str] = []
    for s in samples:
        text = clean(codec.decode(s.ids[s.prompt_len:].tolist()))
        if text is not None and text not in seen:
            seen.add(text)
            out.append(text)
    return out, stats
