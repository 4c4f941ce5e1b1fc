"""(b) EAGLE-3 heads loaded by both engines: draft-vocab logits, pre-norm states and the d2t
mapping over a draft extend and draft decode steps."""

from __future__ import annotations

import pytest
import torch

from conformance.compare import assert_hidden_match, assert_logits_match
from conformance.scenarios import head_steps
from conformance.sglang_cpu import head_aux_layer_ids, load_head, set_capture
from conformance.specsplit_side import default_head, head_dir, our_head
from specsplit.checkpoints.eagle_head import RANDOM_HEAD

_DEFAULT = default_head()
HEADS = [
    pytest.param(RANDOM_HEAD, id="random-head"),
    pytest.param(_DEFAULT, id="default-head", marks=pytest.mark.skipif(
        _DEFAULT is None, reason="the draft service's default head for the embedded target is a random one")),
]


@pytest.mark.parametrize("head", HEADS)
def test_head_matches_sglang(head: str, sglang_target: torch.nn.Module, prompt: torch.Tensor) -> None:
    path = head_dir(head)
    set_capture(sglang_target, head_aux_layer_ids(path))
    sglang_head, ours = load_head(path, sglang_target), our_head(head)

    ref_map = sglang_head.get_hot_token_id()
    draft_ids = torch.arange(ours.cfg.draft_vocab_size)
    if ref_map is None:  # no d2t: the draft vocabulary is the target's
        ref_map = draft_ids
    assert torch.equal(ours.to_target_ids(draft_ids), ref_map.long()), "d2t maps draft ids differently"

    for s in head_steps(sglang_head, ours, sglang_target, prompt):
        assert_logits_match(f"{head}: {s.what}: draft logits", s.logits, s.ref_logits)
        assert_hidden_match(f"{head}: {s.what}: pre-norm states", s.hidden, s.ref_hidden)
        assert torch.equal(s.target_ids, s.ref_target_ids), f"{s.what}: greedy draft token maps differently"
