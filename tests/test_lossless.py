"""Greedy speculative decoding equals target-only greedy decoding, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.replay import ReplayDraft, Replayer
from draft_service.config import DraftConfig
from gateway.clients import LocalDraft
from gateway.local import LocalEngines
from gateway.scheduler import GenerationRequest
from specsplit.ops import Sampling
from specsplit.tokenizer import TextCodec
from target_service.config import TargetConfig

TINY_PROMPTS = [[1, 2, 3], [7] * 20, [100, 42, 17, 250, 3, 3, 9], list(range(10, 60))]
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]


def request(ids: list[int], steps: int, max_new: int, stops: set[int]) -> GenerationRequest:
    return GenerationRequest(ids, max_new, Sampling(), stops, steps)


def check_lossless(engines: LocalEngines, prompts: list[list[int]], max_new: int, stops: set[int],
                   steps_range: range, replay_rate: float | None = None) -> list[float]:
    base = engines.generate([request(p, 0, max_new, stops) for p in prompts])
    taus = []
    for steps in steps_range:
        draft = None
        if replay_rate is not None:
            refs = [p + b.tokens for p, b in zip(prompts, base, strict=True)]
            replayer = Replayer(refs, replay_rate, engines.target.model.cfg.vocab_size)
            draft = ReplayDraft(LocalDraft(engines.draft), replayer)
        spec = engines.generate([request(p, steps, max_new, stops) for p in prompts], draft)
        for p, b, s in zip(prompts, base, spec, strict=True):
            assert s.tokens == b.tokens, f"num_steps={steps} prompt={p[:8]}...: speculative output differs"
            assert s.finish == b.finish
            taus.append(s.stats.mean_accepted_length)
    stats = engines.target.stats()
    assert stats["active_sequences"] == 0 and stats["ring_rows_in_use"] == 0
    assert engines.draft is not None and engines.draft.stats()["active_sequences"] == 0
    return taus


def test_tiny_random_model_lossless_steps_1_to_6(tiny_engines: LocalEngines) -> None:
    check_lossless(tiny_engines, TINY_PROMPTS, 40, {511}, range(1, 7))


def test_tiny_lossless_with_high_acceptance(tiny_engines: LocalEngines) -> None:
    """Replayed acceptance exercises multi-token accepts, KV rollback and ring reuse."""
    taus = check_lossless(tiny_engines, TINY_PROMPTS, 40, {511}, range(1, 7), replay_rate=0.8)
    assert sum(taus) / len(taus) > 2.0


@pytest.fixture(scope="module")
def smollm2_engines(smollm2_dir: Path) -> LocalEngines:
    engines = LocalEngines(TargetConfig(model=str(smollm2_dir), max_context=512, dtype="float32"),
                           DraftConfig(head="random", target=str(smollm2_dir), max_context=512))
    yield engines
    engines.close()


@pytest.mark.slow
def test_smollm2_fp32_lossless_steps_1_to_6(smollm2_engines: LocalEngines, smollm2_dir: Path) -> None:
    codec = TextCodec.from_checkpoint(smollm2_dir)
    prompts = [codec.encode(codec.render_chat(p)) for p in CHAT_PROMPTS]
    check_lossless(smollm2_engines, prompts, 20, {2}, range(1, 7))
    taus = check_lossless(smollm2_engines, prompts, 20, {2}, range(2, 7, 2), replay_rate=0.85)
    assert max(taus) > 2.0


def test_concurrent_sequences_equal_solo_runs(tiny_engines: LocalEngines) -> None:
    solo = [tiny_engines.generate([request(p, s, 30, {511})])[0].tokens
            for p, s in zip(TINY_PROMPTS, [0, 2, 4, 6], strict=True)]
    together = tiny_engines.generate([request(p, s, 30, {511}) for p, s in zip(TINY_PROMPTS, [0, 2, 4, 6],
                                                                                strict=True)])
    assert [r.tokens for r in together] == solo


@pytest.mark.parametrize("slots", [1, 2])
def test_draft_failure_mid_generation_keeps_tokens_and_never_stalls(tiny_target: Path, tiny_head: Path,
                                                                    slots: int) -> None:
    """The draft fails once and is back at once: with a free KV slot the sequence is
    resynced (Recapture); without one it goes on target-only. Tokens never change."""
    import asyncio

    engines = LocalEngines(TargetConfig(model=str(tiny_target), max_context=256, max_sequences=slots),
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), max_context=256))
    try:
        (base,) = engines.generate([request([5, 6, 7], 0, 40, set())])

        class FailsOnce:
            calls = 0

            async def step(self, ops, timeout=0.0, meanwhile=None):  # noqa: ANN001, ANN202
                self.calls += 1
                if self.calls == 4:  # back a moment later, as the gateway's recovery would bring it
                    asyncio.get_running_loop().call_later(0.02, engines.scheduler.draft_restored)
                    raise ConnectionError("draft went away")
                return await LocalDraft(engines.draft).step(ops, meanwhile=meanwhile)

        flaky = FailsOnce()
        (spec,) = engines.generate([request([5, 6, 7], 3, 40, set())], flaky)
        assert spec.tokens == base.tokens and spec.finish == "length"
        if slots > 1:
            assert flaky.calls > 5  # resynced: the draft was used again after the failure
        assert engines.draft.stats()["active_sequences"] == 0 and engines.target.stats()["active_sequences"] == 0
    finally:
        engines.close()
