"""(c) The capture-layer convention. A head config naming eagle_aux_hidden_state_layer_ids gives
the same capture in both engines: SGLang adds one to each id and captures at a layer's input,
we capture the named layers' outputs."""

from __future__ import annotations

from pathlib import Path

import torch

from conformance.compare import assert_hidden_match, assert_logits_match
from conformance.scenarios import MAX_LEN, target_steps
from conformance.sglang_cpu import head_aux_layer_ids, set_capture
from conformance.specsplit_side import our_target
from specsplit.checkpoints.eagle_head import random_head, save_head
from specsplit.checkpoints.target_checkpoint import load_target_config
from specsplit.models.batch import Batch
from specsplit.models.llama import LlamaModel

# Not the default ([1, 14, 26] for 30 layers); 0 and 28 are the lowest and highest SGLang can express.
LAYER_IDS = [0, 13, 28]


def test_configured_layer_ids_capture_the_same(sglang_target: torch.nn.Module, our_default_target: LlamaModel,
                                               target_dir: Path, prompt: torch.Tensor, tmp_path: Path) -> None:
    cfg, weights = random_head(load_target_config(target_dir), aux_layer_ids=LAYER_IDS, seed=3)
    save_head(tmp_path, cfg, weights)
    ids = head_aux_layer_ids(tmp_path)
    assert ids == LAYER_IDS
    set_capture(sglang_target, ids)
    ours = our_target(draft_config=tmp_path / "config.json")

    steps = target_steps(sglang_target, ours, prompt)
    for s in steps:
        assert_logits_match(f"ids {LAYER_IDS}: {s.what}: logits", s.logits, s.ref_logits)
        assert_hidden_match(f"ids {LAYER_IDS}: {s.what}: aux states", s.hidden, s.ref_hidden)

    _, default_aux = our_default_target(prompt, Batch.sequence(prompt, capture=True),
                                        our_default_target.new_cache(1, MAX_LEN))
    assert not torch.allclose(steps[0].hidden, default_aux), "the configured ids changed nothing"
