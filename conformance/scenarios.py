"""The forward passes both engines run, step by step, on identical inputs.

Each step feeds the next one SGLang's greedy choice, so one engine's drift cannot
change the other's input; every step extends the same sequence through each
engine's own KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conformance.sglang_cpu import SGLangSequence
from specsplit.models.batch import Batch
from specsplit.models.eagle3 import Eagle3Head
from specsplit.models.llama import LlamaModel

MAX_LEN = 128
DECODE_STEPS = 2
VERIFY_CHAIN = 4


@dataclass
class Step:
    what: str
    logits: torch.Tensor
    ref_logits: torch.Tensor
    hidden: torch.Tensor  # a target's aux states [N, 3H], a head's pre-norm states [N, H]
    ref_hidden: torch.Tensor
    target_ids: torch.Tensor | None = None  # a head's greedy draft token, mapped to the target vocabulary
    ref_target_ids: torch.Tensor | None = None


def target_steps(sglang_target: torch.nn.Module, ours: LlamaModel, prompt: torch.Tensor) -> list[Step]:
    """Prefill, decode steps, then a verify of a chain of tokens: logits and captured aux states."""
    seq, cache = SGLangSequence(sglang_target, MAX_LEN), ours.new_cache(1, MAX_LEN)
    steps: list[Step] = []

    def step(what: str, mode: str, tokens: torch.Tensor, start: int) -> torch.Tensor:
        ref_logits, ref_aux = seq.forward(mode, tokens, start)
        logits, aux = ours(tokens, Batch.sequence(tokens, start, capture=True), cache)
        if mode == "prefill":
            logits = logits[-1:]  # SGLang's prefill computes the last token's logits only
        steps.append(Step(what, logits, ref_logits, aux, ref_aux))
        return ref_logits[-1:].argmax(-1)

    pos = prompt.shape[0]
    token = step(f"target prefill ({pos} tokens)", "prefill", prompt, 0)
    for i in range(DECODE_STEPS):
        token = step(f"target decode {i + 1}", "decode", token, pos)
        pos += 1
    chain = torch.cat([token, prompt[1:VERIFY_CHAIN]])  # the greedy token, then arbitrary draft tokens
    step(f"target verify ({VERIFY_CHAIN}-token chain)", "verify", chain, pos)
    return steps


def head_steps(sglang_head: torch.nn.Module, ours: Eagle3Head, sglang_target: torch.nn.Module,
               prompt: torch.Tensor, decode_steps: int = 3) -> list[Step]:
    """The head over SGLang's target features for the prompt (each position's features with the
    next token, as EAGLE-3 drafts), then draft decode steps on its own pre-norm states."""
    target_logits, aux = SGLangSequence(sglang_target, MAX_LEN).forward("prefill", prompt, 0)
    tokens = torch.cat([prompt[1:], target_logits[-1:].argmax(-1)])
    seq, cache = SGLangSequence(sglang_head, MAX_LEN), ours.new_cache(1, MAX_LEN)
    hot_token_id = sglang_head.get_hot_token_id()  # SGLang's d2t: draft id -> target id
    steps: list[Step] = []
    hidden, pos = aux, 0
    for i in range(decode_steps + 1):
        mode = "draft_extend" if i == 0 else "decode"
        ref_logits, ref_pre = seq.forward(mode, tokens, pos, hidden)
        logits, pre = ours(tokens, Batch.sequence(tokens, pos, hidden=hidden), cache)
        draft_id = ref_logits[-1:].argmax(-1)
        ref_ids = hot_token_id[draft_id] if hot_token_id is not None else draft_id
        steps.append(Step("draft extend" if i == 0 else f"draft decode {i}", logits, ref_logits, pre, ref_pre,
                          ours.to_target_ids(draft_id), ref_ids))
        pos += tokens.shape[0]
        tokens, hidden = ref_ids, ref_pre[-1:]
    return steps
