"""Speculative sampling preserves the target's distribution (statistical tests)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from draft_service.config import DraftConfig
from gateway.local import LocalEngines
from gateway.scheduler import GenerationRequest
from specsplit.checkpoints.eagle_head import random_head, save_head
from specsplit.checkpoints.target_checkpoint import load_target_config
from specsplit.checkpoints.tiny import tiny_config, write_tiny_target
from specsplit.models.batch import Batch
from specsplit.models.llama import LlamaModel
from specsplit.ops import Sampling
from specsplit.sampling import probs_from_logits, verify_chain
from target_service.config import TargetConfig


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square goodness of fit (cells with expectation < 5 pooled)."""
    from scipy.stats import chisquare

    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)]).double()
    exp = torch.cat([expected[big], expected[~big].sum().view(1)]).double()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def test_probs_from_logits_filters() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = probs_from_logits(logits, Sampling(temperature=1.0, top_k=2))
    assert torch.count_nonzero(p) == 2
    p = probs_from_logits(logits, Sampling(temperature=1.0, top_p=0.5))
    assert torch.count_nonzero(p) == 1  # the top token already holds > 50%
    assert torch.allclose(p.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=6),
                                      Sampling(temperature=1.0, top_p=0.8)])
def test_verify_chain_first_token_follows_target(sampling: Sampling) -> None:
    """Draft from a different distribution q; every emitted first token must follow p (the
    target's draws counter-based: a seed a trial)."""
    g = torch.Generator().manual_seed(0)
    vocab, k, n = 10, 3, 20000
    target_logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    draft_logits = torch.randn(k, vocab, generator=g) * 1.5
    q = probs_from_logits(draft_logits, Sampling(temperature=1.0))
    p = probs_from_logits(target_logits, sampling)
    counts = torch.zeros(vocab)
    second = torch.zeros(vocab)
    drafted = torch.zeros(vocab)  # negative control: the draft's own first tokens
    gen = torch.Generator().manual_seed(1)
    accepted_any = 0
    dists = [(list(range(vocab)), q[i].tolist()) for i in range(k)]
    for trial in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        a, tokens = verify_chain(target_logits, drafts, dists, replace(sampling, seed=trial), 7)
        counts[tokens[0]] += 1
        drafted[drafts[0]] += 1
        accepted_any += a > 0
        if tokens[0] == drafts[0] and a >= 1:  # conditional on the first draft token accepted
            second[tokens[1]] += 1
    assert 0.05 < accepted_any / n < 0.95  # both paths exercised
    assert chi_square_p(counts, p[0]) > 1e-3
    assert chi_square_p(drafted, p[0]) < 1e-6  # the test can tell a wrong distribution
    # tokens[1] given tokens[0] == drafts[0] follows p[1] (the target's next-position distribution)
    assert chi_square_p(second, p[1]) > 1e-3


def test_end_to_end_sampling_follows_target_distribution(tmp_path: Path) -> None:
    """A 16-token model: the second and third generated tokens, marginalised over the
    first, must follow the target model's exact distribution."""
    cfg = tiny_config(vocab=16, hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64)
    cfg.eos_token_ids = []
    target_dir = write_tiny_target(tmp_path / "t", cfg, seed=3, std=0.3)
    head_cfg, weights = random_head(load_target_config(target_dir), draft_vocab_size=12, seed=4, std=0.3)
    save_head(tmp_path / "h", head_cfg, weights)
    assert json.loads((tmp_path / "h" / "config.json").read_text())["draft_vocab_size"] == 12
    sampling = Sampling(temperature=1.0)
    prompt = [3, 1, 4, 1, 5]
    engines = LocalEngines(TargetConfig(model=str(target_dir), max_context=64, max_sequences=8),
                           DraftConfig(head=str(tmp_path / "h"), target=str(target_dir), max_context=64,
                                       max_sequences=8))
    try:
        n = 2500
        reqs = [GenerationRequest(prompt, 3, Sampling(1.0, 1.0, 0, seed), set(), 2) for seed in range(n)]
        results = engines.generate(reqs)
        taus = [r.stats.mean_accepted_length for r in results]
        assert 1.05 < sum(taus) / n < 2.95  # some drafts accepted, some rejected
        seq = torch.tensor([r.tokens for r in results])  # [n, 3]
        # exact joint of the first two generated tokens from the target model
        model: LlamaModel = engines.target.model
        cache = model.new_cache(1, 16)
        p1 = probs_from_logits(model(torch.tensor(prompt), Batch.sequence(torch.tensor(prompt)), cache)[0][-1:],
                              sampling)[0]
        joint = torch.zeros(16, 16)
        for t1 in range(16):
            ids = torch.tensor(prompt + [t1])
            p2 = probs_from_logits(model(ids, Batch.sequence(ids), cache)[0][-1:], sampling)[0]
            joint[t1] = p1[t1] * p2
        observed = torch.zeros(16, 16)
        for a, b in seq[:, :2].tolist():
            observed[a, b] += 1
        assert chi_square_p(observed.flatten(), joint.flatten()) > 1e-3
        second = torch.bincount(seq[:, 1], minlength=16).float()
        assert chi_square_p(second, joint.sum(0)) > 1e-3
    finally:
        engines.close()


def test_counter_based_draws_follow_the_distribution_and_depend_on_seed_and_position_only() -> None:
    """pick: over 20,000 seeds a token follows p (and would not follow a wrong q); a (seed,
    position) always gives the same token, batched or alone; the acceptance stream's uniforms
    are uniform and independent of the tokens' stream."""
    from specsplit.sampling import ACCEPT, pick, uniforms

    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(1, 12, generator=g) * 1.5, -1)
    seeds = torch.stack([torch.arange(20000), torch.full((20000,), 3)], 1)  # [N, 2]: low, high 32 bits
    counts = torch.bincount(pick(p.expand(20000, 12), seeds, torch.full((20000,), 3)), minlength=12).float()
    assert chi_square_p(counts, p[0]) > 1e-3
    assert chi_square_p(counts, torch.full((12,), 1 / 12)) < 1e-6
    rows, seed = p.expand(6, 12), torch.tensor([[42, 0]])
    batched = pick(rows, seed.expand(6, 2), torch.arange(10, 16))
    alone = torch.stack([pick(p, seed, torch.tensor([i]))[0] for i in range(10, 16)])
    assert torch.equal(batched, alone) and torch.equal(pick(rows, seed.expand(6, 2), torch.arange(10, 16)), batched)
    u = uniforms(torch.tensor([[9, 0]]).expand(20000, 2), torch.arange(20000), ACCEPT, 1)[:, 0]
    assert float(u.min()) > 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert chi_square_p(torch.histc(u.float(), 20, 0, 1), torch.full((20,), 0.05)) > 1e-3


def test_rows_of_different_samplings_choose_as_each_alone() -> None:
    """choose over a batch of a greedy row and rows with their own temperature, top-k, top-p and
    seed gives each row's select_token, bit for bit, and probs_rows each row's probs_from_logits."""
    from specsplit.sampling import choose, probs_rows, sampling_rows, select_token

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=g) * 3
    samplings = [Sampling(), Sampling(temperature=0.7, top_k=5, seed=1), Sampling(temperature=1.3, top_p=0.6, seed=2),
                 Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=2**40 + 3)]
    rows = torch.from_numpy(sampling_rows(samplings))
    positions = torch.tensor([4, 9, 9, 17])
    got = choose(logits, rows, positions).tolist()
    assert got == [select_token(logits[i], s, int(positions[i])) for i, s in enumerate(samplings)]
    assert got[0] == int(logits[0].argmax())
    probs = probs_rows(logits, rows)
    for i, s in enumerate(samplings[1:], 1):
        assert torch.equal(probs[i], probs_from_logits(logits[i : i + 1], s)[0])
    assert torch.count_nonzero(probs[1]) == 5 and float(probs[2].max()) > 0
