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
    assert static_engines.draft is not None and static_engines.draft.engine.step_path == "the padded path, eagerly"
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


def test_verify_steps_accept_alike_on_every_path(tiny_target: Path) -> None:
    """One verify step of a tree (the target's path at scattered nodes, twin siblings), a chain
    accepted in part, and a row accepted on the host (path [0]), batched: the eager, padded and
    fused-packed paths accept the same paths, give the same argmax, put the same KV entries at
    the committed positions and the path's features first."""
    from specsplit.runner.runner import ModelRunner, Row, Step
    from tests.test_fused_decode import PaddedAsFused

    model = tiny_model(tiny_target)
    prompts = [p[:6] for p in TINY_PROMPTS[:3]]
    ref = ModelRunner(model, 3, 64)
    greedy = []
    for slot, prompt in enumerate(prompts):  # each prompt's greedy continuation, 5 tokens
        tokens = list(prompt)
        for _ in range(5):
            ((logits, _),) = ref.run(Step([Row(slot, 0, tokens)]))  # the whole sequence again
            tokens.append(int(logits[-1].argmax()))
        greedy.append(tokens[len(prompt):])
    g0, g1, g2 = greedy
    wrong = [(t + 1) % 512 for t in g0]
    # row 0, a tree under g0[0]: wrong[1] and g0[1] twice (twins: the first, node 2, is walked), g0[2]
    # under the second twin, g0[2] (node 5) then g0[3] (node 6) under the first
    tree = Row(0, len(prompts[0]), [g0[0], wrong[1], g0[1], g0[1], g0[2], g0[2], g0[3]], [-1, 0, 0, 0, 3, 2, 5],
               accept=True)
    chain = Row(1, len(prompts[1]), [g1[0], g1[1], wrong[2]], accept=True)
    host = Row(2, len(prompts[2]), [g2[0], g2[1]])
    runners = {"eager": ModelRunner(model, 3, 64), "padded": ModelRunner(model, 3, 64, padded_tokens=16),
               "fused": ModelRunner(model, 3, 64, fused=PaddedAsFused(model))}  # type: ignore[arg-type]
    runners["padded"].padded = True
    out = {}
    for name, r in runners.items():
        for slot, prompt in enumerate(prompts):
            r.run(Step([Row(slot, 0, prompt)]))
        out[name] = r.verify(Step([tree, chain, host], capture=True))
    want = out["eager"]
    assert [v.path for v in want] == [[0, 2, 5, 6], [0, 1], [0]]
    assert want[0].best[3] == g0[4] and want[1].best[1] == g1[2]  # the target's token after the path
    assert want[2].best == g2[1:3]
    for name in ("padded", "fused"):
        got = out[name]
        for v, w, row in zip(got, want, (tree, chain, host), strict=True):
            assert v.path == w.path and v.best == w.best
            n = len(v.path)
            assert v.features is not None and w.features is not None
            torch.testing.assert_close(v.features[:n], w.features[:n], rtol=1e-4, atol=1e-4)
            for a, b in ((runners[name].cache.k, runners["eager"].cache.k),
                         (runners[name].cache.v, runners["eager"].cache.v)):
                end = row.start + n  # the committed entries after the step
                torch.testing.assert_close(a[:, row.slot, :end], b[:, row.slot, :end], rtol=1e-4, atol=1e-4)


def test_batches_up_to_the_few_rows_run_unpadded(tiny_target: Path) -> None:
    """Batch buckets: every size up to the fused step's few rows, then powers of two, so a batch
    of 3 decodes runs as 3 rows (the few-row path, a decode's bits a row) and a batch of 5 as 6 (the
    slots);
    without a fused step, powers of two only. The tokens are the eager path's either way."""
    from specsplit.runner.graphs import batch_buckets
    from specsplit.runner.runner import ModelRunner, Row, Step
    from tests.test_fused_decode import PaddedAsFused

    assert batch_buckets(16) == (1, 2, 4, 8, 16) and batch_buckets(16, 3) == (1, 2, 3, 4, 8, 16)
    assert batch_buckets(6, 8) == (1, 2, 3, 4, 5, 6) and batch_buckets(2, 3) == (1, 2)
    model = tiny_model(tiny_target)
    fused = PaddedAsFused(model)
    runners = {"eager": ModelRunner(model, 6, 64), "fused": ModelRunner(model, 6, 64, fused=fused)}  # type: ignore[arg-type]
    assert runners["eager"].batch_buckets == (1, 2, 4, 6) and runners["fused"].batch_buckets == (1, 2, 3, 4, 6)
    prompts = [p[:6] for p in (TINY_PROMPTS * 2)[:5]]
    best = {}
    for name, r in runners.items():
        for slot, prompt in enumerate(prompts):
            r.run(Step([Row(slot, 0, prompt)]))
        best[name] = [[v.best for v in r.verify(Step([Row(slot, len(prompts[slot]), [prompts[slot][-1]])
                                                      for slot in slots]))] for slots in ([0, 1, 2], [0, 1, 2, 3, 4])]
    assert best["fused"] == best["eager"]
    assert fused.rows[-2:] == [(3, 1), (6, 1)]
