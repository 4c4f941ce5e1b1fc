"""The padded static-batch path (what CUDA graphs capture), checked eagerly on CPU against
the per-segment path: same logits and features, padding never leaks, engines stay lossless."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_service.config import DraftConfig
from gateway.local import LocalEngines
from specsplit.checkpoints.target_checkpoint import load_safetensors_dir, load_target_config
from specsplit.models.batch import Batch, Segment
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import TensorParallel
from specsplit.ops import Sampling
from target_service.config import TargetConfig
from tests.test_lossless import TINY_PROMPTS, check_lossless, request


def tiny_model(tiny_target: Path) -> LlamaModel:
    cfg = load_target_config(tiny_target)
    model = LlamaModel(cfg, TensorParallel(), cfg.default_aux_layer_ids())
    model.load_full_weights(load_safetensors_dir(tiny_target))
    return model.eval()


def test_padded_batch_equals_ragged_batch(tiny_target: Path) -> None:
    """Two sequences of different lengths in slots 2 and 0, padded to T=4 in a batch of 4
    (padding rows in spare slot 3), against the same step run per segment."""
    model = tiny_model(tiny_target)
    g = torch.Generator().manual_seed(0)
    prompts = {2: torch.randint(0, 512, (9,), generator=g), 0: torch.randint(0, 512, (5,), generator=g)}
    chains = {2: torch.randint(0, 512, (4,), generator=g), 0: torch.randint(0, 512, (2,), generator=g)}
    caches = [model.new_cache(4, 64), model.new_cache(4, 64)]
    for cache in caches:
        for slot, p in prompts.items():
            model(p, Batch.sequence(p, slot=slot), cache)
    ragged = Batch.ragged([Segment(2, 9, 4), Segment(0, 5, 2)], "cpu", capture=True)
    ref_logits, ref_aux = model(torch.cat([chains[2], chains[0]]), ragged, caches[0])
    tokens = torch.zeros(4, 4, dtype=torch.long)
    tokens[0], tokens[1, :2] = chains[2], chains[0]
    positions = torch.arange(4).repeat(4, 1)
    positions[0] += 9
    positions[1] += 5
    slots = torch.tensor([2, 0, 3, 3])
    logits, aux = model(tokens.view(-1), Batch.padded(positions, slots, positions, 16, capture=True), caches[1])
    logits, aux = logits.view(4, 4, -1), aux.view(4, 4, -1)
    torch.testing.assert_close(logits[0], ref_logits[:4], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1, :2], ref_logits[4:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(aux[0], ref_aux[:4], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(aux[1, :2], ref_aux[4:], rtol=1e-4, atol=1e-4)
    # the real KV entries are the same; slot 0's padding went past its chain (positions 7, 8), never before
    torch.testing.assert_close(caches[1].k[:, 2, :13], caches[0].k[:, 2, :13], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[1].k[:, 0, :7], caches[0].k[:, 0, :7], rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(caches[1].k[:, 1]) == 0  # an unused slot is untouched


@pytest.fixture(scope="module")
def static_engines(tiny_target: Path, tiny_head: Path) -> LocalEngines:
    engines = LocalEngines(TargetConfig(model=str(tiny_target), max_context=256),
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), max_context=256))
    assert engines.draft is not None
    engines.target.engine.runner.padded = engines.draft.engine.runner.padded = True
    yield engines
    engines.close()


def test_static_engines_lossless_with_replayed_acceptance(static_engines: LocalEngines) -> None:
    """Verifies of different lengths and sequences of different num_steps share static batches."""
    check_lossless(static_engines, TINY_PROMPTS, 30, {511}, range(1, 7, 2), replay_rate=0.8)
    mixed = static_engines.generate([request(p, s, 30, {511}) for p, s in zip(TINY_PROMPTS, [1, 2, 4, 6],
                                                                              strict=True)])
    solo = static_engines.generate([request(TINY_PROMPTS[0], 0, 30, {511})])
    assert mixed[0].tokens == solo[0].tokens


def test_static_and_eager_engines_agree_with_sampling(tiny_target: Path, tiny_head: Path,
                                                      static_engines: LocalEngines) -> None:
    eager = LocalEngines(TargetConfig(model=str(tiny_target), max_context=256),
                         DraftConfig(head=str(tiny_head), target=str(tiny_target), max_context=256))
    try:
        reqs = [request(p, s, 30, set()) for p, s in zip(TINY_PROMPTS, [3, 5, 2, 4], strict=True)]
        for i, r in enumerate(reqs):
            r.sampling = Sampling(temperature=0.8, top_p=0.95, seed=100 + i)
        a = [r.tokens for r in eager.generate(reqs)]
        b = [r.tokens for r in static_engines.generate(reqs)]
        assert a == b
    finally:
        eager.close()
