"""bench/plain_loop.py, the in-process reference of the benchmarks: it counts tokens as the
gateway streams them (at most max_new), so its tokens/s and tau compare with the services'."""

from __future__ import annotations

from pathlib import Path

from bench.plain_loop import generate
from bench.replay import Replayer
from draft_service.config import DraftConfig
from gateway.local import LocalEngines
from target_service.config import TargetConfig


def test_the_last_cycle_is_cut_at_max_new(tiny_target: Path, tiny_head: Path) -> None:
    engines = LocalEngines(TargetConfig(model=str(tiny_target), max_context=256),
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), max_context=256))
    assert engines.draft is not None
    prompt = [5, 9, 13, 2, 7]
    reference = generate(engines.target, None, prompt, 30, 0)
    assert len(reference.tokens) == 30 and reference.cycles == 29  # target-only: one token a cycle
    replayer = Replayer([prompt + reference.tokens], 1.0, engines.target.model.cfg.vocab_size)
    run = generate(engines.target, engines.draft, prompt, 10, 4, replayer)  # every proposal right: 5 tokens a cycle
    assert run.cycles == 2  # 1 + 5 + 5 = 11 tokens made, 10 counted
    assert run.tokens == reference.tokens[:10]
    tree = generate(engines.target, engines.draft, prompt, 30, 3, None, topk=4, num_draft_tokens=12)
    assert tree.tokens == reference.tokens  # the plain loop verifies trees too
    replayed = generate(engines.target, engines.draft, prompt, 10, 4, replayer, topk=4, num_draft_tokens=12)
    assert replayed.cycles == 2 and replayed.tokens == reference.tokens[:10]  # replay turns the tree into a chain
