"""Rows from entry 0 (prompts, recomputed sequences) in the prompts layout: grouped by padded
length, one forward a group, logits of each row's last token only; the same numbers as each
prompt run alone, and bit for bit the same whatever else shares its step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specsplit.models.batch import Batch
from specsplit.models.eagle3 import Eagle3Config, Eagle3Head
from specsplit.runner import prompts as prompts_mod
from specsplit.runner.prompts import prompt_bucket, prompt_groups
from specsplit.runner.runner import ModelRunner, Row, Step
from tests.test_static_batches import tiny_model

pytestmark = pytest.mark.quick

PROMPTS = [[1, 2, 3], [7] * 20, [100, 42, 17, 250, 3, 3, 9], list(range(10, 60)), [5] * 17]


def test_buckets_and_groups() -> None:
    assert [prompt_bucket(n, 4096) for n in (1, 16, 17, 256, 257, 300)] == [16, 16, 32, 256, 320, 320]
    assert prompt_bucket(1000, 1000) == 1000  # never past the cache
    # buckets 16: rows 0, 2; 32: rows 1, 4; 64: row 3 -- the longest bucket first, rows in their order
    assert prompt_groups([len(p) for p in PROMPTS], 4096) == [[3], [1, 4], [0, 2]]


def test_groups_hold_at_most_prompt_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompts_mod, "PROMPT_TOKENS", 64)
    assert prompt_groups([10] * 5 + [100], 4096) == [[5], [0, 1, 2, 3], [4]]  # 112 alone; 16 tokens each: 4 a group


def test_prompt_rows_equal_each_prompt_alone(tiny_target: Path) -> None:
    """Five prompts in three groups (and a continuing row beside them: run apart) against each
    prompt run alone through the ragged layout: the last token's logits, every token's features
    and the KV entries agree; padding writes only entries past a row's end."""
    model = tiny_model(tiny_target)
    runner = ModelRunner(model, 8, 128)
    ref = model.new_cache(8, 128)
    want = []
    for slot, p in enumerate(PROMPTS):
        ids = torch.tensor(p)
        want.append(model(ids, Batch.sequence(ids, slot=slot, capture=True), ref))
    runner.run(Step([Row(6, 0, [9, 9, 9, 9])]))  # a sequence to continue beside the prompts
    got = runner.verify(Step([Row(slot, 0, p) for slot, p in enumerate(PROMPTS)] + [Row(6, 4, [8])], capture=True))
    for slot, (p, v, (logits, aux)) in enumerate(zip(PROMPTS, got, want, strict=False)):
        assert v.logits.shape == (1, logits.shape[-1])
        torch.testing.assert_close(v.logits[0], logits[-1], rtol=1e-5, atol=1e-5)
        assert v.features is not None and aux is not None
        torch.testing.assert_close(v.features, aux, rtol=1e-5, atol=1e-5)
        assert v.best == [int(logits[-1].argmax())]
        n = len(p)
        torch.testing.assert_close(runner.cache.k[:, slot, :n], ref.k[:, slot, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(runner.cache.v[:, slot, :n], ref.v[:, slot, :n], rtol=1e-5, atol=1e-5)
    assert got[-1].logits.shape[0] == 1 and got[-1].path == [0]  # the continuing row: its own step
    assert torch.count_nonzero(runner.cache.k[:, 7]) == 0  # an unused slot is untouched


def test_a_prompt_computes_the_same_bits_in_any_company(tiny_target: Path) -> None:
    """The same prompt alone, with prompts of its bucket and with prompts of others: the same
    bits (its shape is its own bucket's, whatever shares the step)."""
    model = tiny_model(tiny_target)
    p = PROMPTS[1]
    outs = []
    for company in ([], [PROMPTS[4]], [PROMPTS[4], [11] * 30, PROMPTS[0], PROMPTS[3]]):
        runner = ModelRunner(model, 8, 128)
        (v, *_) = runner.verify(Step([Row(0, 0, p)] + [Row(i + 1, 0, c) for i, c in enumerate(company)],
                                     capture=True))
        assert v.features is not None
        outs.append((v.logits.clone(), v.features.clone(), runner.cache.k[:, 0, : len(p)].clone()))
    for logits, features, keys in outs[1:]:
        assert torch.equal(logits, outs[0][0]) and torch.equal(features, outs[0][1]) and torch.equal(keys, outs[0][2])


def test_head_prompt_rows_equal_ragged() -> None:
    """The draft head's prompt rows (target features as its hidden input): logits of the last
    token and every token's pre-norm state, as each row run alone."""
    cfg = Eagle3Config(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                       vocab_size=200, draft_vocab_size=100, target_hidden_size=64, rope_theta=10000.0,
                       rms_norm_eps=1e-5, max_position=256)
    torch.manual_seed(0)
    head = Eagle3Head(cfg).eval()
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.05) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    rows = [[3, 4, 5], [6] * 21, [7, 8]]
    hidden = [torch.randn(len(r), 3 * 64) for r in rows]
    runner = ModelRunner(head, 4, 64)
    got = runner.run(Step([Row(i, 0, r) for i, r in enumerate(rows)], hidden=hidden))
    cache = head.new_cache(4, 64)
    for i, (r, h) in enumerate(zip(rows, hidden, strict=True)):
        ids = torch.tensor(r)
        logits, prenorm = head(ids, Batch.sequence(ids, slot=i, hidden=h), cache)
        torch.testing.assert_close(got[i][0], logits[-1:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[i][1], prenorm, rtol=1e-5, atol=1e-5)


def test_a_step_of_every_kind_of_row_runs_each_kind_on_its_own_path(tiny_target: Path) -> None:
    """As on the GPU (the fused path stood in for by PaddedAsFused, padded rows on): one verify
    step of two prompts, a long part of a prompt, a short part and two decodes. The prompts run
    in their layout, the parts eagerly (never on the fused path), the decodes fused, by
    themselves; every row gives what a CPU runner (everything eager) gives."""
    from tests.test_fused_decode import PaddedAsFused

    model = tiny_model(tiny_target)
    fused = PaddedAsFused(model)
    fast = ModelRunner(model, 8, 128, fused=fused, padded_tokens=4)  # type: ignore[arg-type]
    fast.padded = True
    eager = ModelRunner(model, 8, 128)
    got, fused_steps = [], []
    for r in (fast, eager):
        for slot, p in ((2, [3] * 9), (3, [4] * 6), (4, [5] * 5), (5, [6] * 7)):
            r.run(Step([Row(slot, 0, p)]))  # committed entries
        fused.rows.clear()
        got.append(r.verify(Step([Row(0, 0, PROMPTS[3]), Row(2, 9, list(range(20, 32)), last_only=True),
                                  Row(3, 6, [7], accept=True), Row(1, 0, PROMPTS[0]),
                                  Row(4, 5, [8, 9], last_only=True), Row(5, 7, [9], accept=True)], capture=True)))
        fused_steps.append(list(fused.rows))
    assert fused_steps == [[(2, 1)], []]  # the two decodes alone, as one fused step
    for v, w in zip(*got, strict=True):
        assert v.logits.shape == w.logits.shape and v.best == w.best and v.path == w.path
        torch.testing.assert_close(v.logits, w.logits, rtol=1e-4, atol=1e-4)
        assert v.features is not None and w.features is not None
        torch.testing.assert_close(v.features, w.features, rtol=1e-4, atol=1e-4)
    assert [v.logits.shape[0] for v in got[0]] == [1, 1, 1, 1, 1, 1]  # prompts and parts: their last token's


def test_prompt_steps_whose_capture_fails_run_eagerly_from_then_on(tiny_target: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Where capturing a prompt step's graph fails (a device whose attention kernel cannot be
    captured), that step and every later one run eagerly, with one warning: the outputs of a
    runner without graphs."""
    model = tiny_model(tiny_target)
    plain, failing = ModelRunner(model, 8, 128), ModelRunner(model, 8, 128)
    tried: list[tuple[object, ...]] = []

    def refuse(key: tuple[object, ...], fn: object, **inputs: object) -> None:
        tried.append(key)
        raise RuntimeError("operation not permitted when stream is capturing")

    failing.graphs.enabled = True  # as on CUDA
    monkeypatch.setattr(failing.graphs, "run", refuse)
    for rows in ([0, 1], [2, 4], [3]):
        want = plain.verify(Step([Row(i, 0, PROMPTS[i]) for i in rows], capture=True))
        got = failing.verify(Step([Row(i, 0, PROMPTS[i]) for i in rows], capture=True))
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w.logits, g.logits) and torch.equal(w.features, g.features)  # type: ignore[arg-type]
            assert w.best == g.best
    assert len(tried) == 1 and failing.graphs.refused == {"prompts"}
    assert caplog.text.count("capturing one failed") == 1


def test_warm_prompts_capture_one_row_a_bucket_and_serving_never_captures_a_prompt_step(
        tiny_target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """warm_prompts captures a one-row graph of every length bucket, with features and without;
    once serving, a step of a few rows whose graph is missing runs them one at a time from those
    graphs instead of capturing one (which would hold up every running sequence); a step of more
    rows captures its own. The outputs are a runner without graphs'."""
    model = tiny_model(tiny_target)
    plain, warmed = ModelRunner(model, 8, 128), ModelRunner(model, 8, 128)
    graphs = warmed.graphs
    graphs.enabled = True  # as on CUDA: "capturing" records the key, then runs eagerly
    ran: list[tuple[object, ...]] = []

    def run(key: tuple[object, ...], fn: prompts_mod.Callable[..., prompts_mod.Outputs], **inputs: object
            ) -> prompts_mod.Outputs:
        ran.append(key)
        graphs.graphs[key] = None  # type: ignore[assignment]
        return graphs.eager(fn, **inputs)  # type: ignore[arg-type]

    monkeypatch.setattr(graphs, "run", run)
    with warmed.mode():
        n = prompts_mod.warm_prompts(warmed, 7)
    buckets = prompts_mod.prompt_buckets(128)
    assert buckets == [16, 32, 48, 64, 80, 96, 112, 128]
    assert n == 2 * len(buckets) and sorted(ran) == sorted(("prompts", 1, t, c, None, True) for t in buckets
                                                           for c in (False, True))
    graphs.serving = True
    for rows in ([[7] * 20] * 3, [[5] * 17] * 6):  # 3 rows of one bucket: one by one; 6: their own graph
        ran.clear()
        step = Step([Row(i, 0, p) for i, p in enumerate(rows)], capture=True)
        want, got = plain.verify(step), warmed.verify(step)
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w.logits, g.logits) and torch.equal(w.features, g.features)  # type: ignore[arg-type]
            assert w.best == g.best
        assert ran == ([("prompts", 1, 32, True, None, True)] * 3 if len(rows) == 3
                       else [("prompts", 8, 32, True, None, True)])
    graphs.serving = False  # (warming up: a missing graph is captured at first use)
    ran.clear()
    warmed.verify(Step([Row(i, 0, [3] * 20) for i in range(2)], capture=True))
    assert ran == [("prompts", 2, 32, True, None, True)]
