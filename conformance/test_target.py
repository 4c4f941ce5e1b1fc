"""(a) The SmolLM2 target: our logits and captured aux states against SGLang's LlamaForCausalLM
with its default EAGLE-3 capture, in prefill, decode steps on the KV cache, and a verify."""

from __future__ import annotations

import torch

from conformance.compare import assert_hidden_match, assert_logits_match
from conformance.scenarios import target_steps
from conformance.sglang_cpu import set_capture
from specsplit.models.llama import LlamaModel


def test_target_matches_sglang(sglang_target: torch.nn.Module, our_default_target: LlamaModel,
                               prompt: torch.Tensor) -> None:
    set_capture(sglang_target, None)  # no ids configured: SGLang's default capture, and ours
    for s in target_steps(sglang_target, our_default_target, prompt):
        assert_logits_match(f"{s.what}: logits", s.logits, s.ref_logits)
        assert_hidden_match(f"{s.what}: aux states", s.hidden, s.ref_hidden)
