"""Dormant sequences (gateway.adaptive): an adaptive request whose plan drafts nothing for a while
lets the draft's state go, so that its cycles cost what speculation off costs; a probe wakes it
(the target recomputes its features, the draft extends over them) and greedy output stays the
target's own throughout."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bench.scheduler_cpu import InstantDraft, InstantTarget
from draft_service.config import DraftConfig
from gateway import adaptive
from gateway.adaptive import DORMANT_AFTER, PROBE_EVERY, PROBE_EXTRA, Choice, StepChooser
from gateway.clients import Meanwhile
from gateway.costs import NO_DRAFT, CostModel, Shape
from gateway.local import LocalEngines
from gateway.scheduler import Finished, Limits, Scheduler
from gateway.sequence import GenerationRequest, Sequence
from specsplit.ops import (
    DraftOp,
    DraftResult,
    ExtendPropose,
    Prefill,
    Recapture,
    Sampling,
    StepTiming,
    TargetOp,
    TargetResult,
    Verify,
)
from target_service.config import TargetConfig
from tests.test_adaptive import adaptive_request, priced, taught
from tests.test_gpu_services import needs_gpus


def test_resync_is_priced_from_prefills_and_whole_prompt_extends() -> None:
    costs = CostModel()
    assert costs.resync_ms(100) is None  # nothing measured: a wake cannot be priced
    costs.record_prefill(64, 2.0)
    assert costs.resync_ms(64) == pytest.approx(4.0)  # an extend not measured yet: priced as the prefill
    costs.record_prefill(256, 5.0)
    costs.record_extend(64, 1.0)
    costs.record_extend(256, 2.0)
    assert costs.resync_ms(256) == pytest.approx(7.0)
    assert costs.resync_ms(100) == pytest.approx(7.0)  # priced as the next measured point above it
    assert costs.resync_ms(1024) > 7.0  # past the largest: the line through the points
    costs.record_prefill(16, 900.0)  # a slow first call of a small prompt prices no larger wake
    assert costs.resync_ms(200) == pytest.approx(7.0)


def zero(s: Sequence, reason: str = "best") -> Choice:
    return Choice(NO_DRAFT, 1.0, 1.0, reason)


def test_a_sequence_rests_after_cycles_in_a_row_that_draft_nothing() -> None:
    chooser = StepChooser(8)
    s = Sequence(1, adaptive_request([1]))
    s.committed = 50
    assert not any(chooser.rests(s, zero(s)) for _ in range(DORMANT_AFTER))  # its wake cannot be priced yet
    chooser.costs.record_prefill(64, 2.0)
    s.idle_cycles = 0
    assert [chooser.rests(s, zero(s)) for _ in range(DORMANT_AFTER)][-2:] == [False, True]
    assert chooser.rests(s, Choice(Shape.chain(2), 2.0, 1.0, "probe"))  # a probe is no plan that drafts
    assert not chooser.rests(s, Choice(Shape.chain(2), 2.0, 1.0, "best")) and s.idle_cycles == 0
    assert not chooser.rests(s, zero(s, "measuring")) and s.idle_cycles == 0  # the plan's choices only


def test_a_probe_wakes_the_cheapest_dormant_sequence_once_its_credit_covers_the_resync() -> None:
    chooser = priced(draft_step_ms=1.0, verify_row_ms=0.5, decode_ms=1.0)
    chooser.costs.record_prefill(64, 4.0)
    chooser.costs.record_prefill(512, 20.0)
    short, long = Sequence(1, adaptive_request([1])), Sequence(2, adaptive_request([1]))
    short.committed, long.committed = 60, 500
    for s in (short, long):
        s.dormant = True
    woken, cycles = None, 0
    while woken is None:
        cycles += 1
        assert cycles < 10_000
        woken = chooser.wake([short, long], 2, planned=False)
    assert woken is short and not short.dormant and short.wake_probe and long.dormant
    assert cycles >= PROBE_EVERY
    # the credit paid for the resync (and had room for the probe, charged when it is made)
    resync = chooser.costs.resync_ms(60)
    assert resync is not None and cycles * adaptive.PROBE_SHARE * chooser.costs.cycle_ms(2, NO_DRAFT) >= resync
    assert chooser.wake([long], 2, planned=False) is None  # the cadence: not again at once


def test_a_woken_sequence_probes_on_its_first_cycle_with_features() -> None:
    chooser = priced(draft_step_ms=3.0, verify_row_ms=1.0, decode_ms=1.0)
    s = taught(chooser, adaptive_request([1]), accepted=0)
    chooser.probed_at = chooser.cycles = 10**6  # no probe due by the cadence
    (c,) = chooser.choose_batch([s], 1)
    assert c.shape == NO_DRAFT
    s.wake_probe = True
    (c,) = chooser.choose_batch([s], 1)
    assert c.reason == "probe" and c.shape == Shape.chain(PROBE_EXTRA) and not s.wake_probe
    credit = chooser.probe_credit
    chooser.settle(1000.0)  # its cycle extends the draft over the whole sequence: the wake paid for that
    assert chooser.probe_credit == credit


def test_a_probe_that_runs_a_shape_first_is_charged_its_expected_loss_only() -> None:
    chooser = priced(draft_step_ms=3.0, verify_row_ms=1.0, decode_ms=1.0)
    s = taught(chooser, adaptive_request([1]), accepted=0)
    chooser.probe_credit = 100.0
    chooser.probed_at = -100
    (c,) = chooser.choose_batch([s], 1)
    assert c.reason == "probe"
    credit = chooser.probe_credit
    chooser.forgive_probe()  # its graphs were captured in this cycle
    chooser.settle(500.0)
    assert chooser.probe_credit == credit


class LoggingTarget(InstantTarget):
    """Accepts nothing; features only where a verify captures them (as the real target)."""

    def __init__(self) -> None:
        super().__init__(accept=False)
        self.log: list[tuple[str, int, bool]] = []  # (op, sequence, capture)

    async def step(self, ops: list[TargetOp], releases: list[int], timeout: float = 0.0,
                   meanwhile: Meanwhile = None) -> tuple[list[TargetResult], StepTiming]:
        results, timing = await super().step(ops, releases, timeout, meanwhile)
        for op in ops:
            if isinstance(op, Verify | Recapture | Prefill):
                self.log.append((type(op).__name__, op.seq_id, getattr(op, "capture", True)))
        capture = {op.seq_id: op.capture for op in ops if isinstance(op, Verify | Prefill)}
        for r in results:
            if not capture.get(r.seq_id, True):
                r.hidden = None
        return results, timing


class LoggingDraft(InstantDraft):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[int, int, int, int]] = []  # (sequence, position, tokens, steps)

    async def step(self, ops: list[DraftOp], timeout: float = 0.0, meanwhile: Meanwhile = None
                   ) -> tuple[list[DraftResult], StepTiming]:
        self.log += [(op.seq_id, op.position, len(op.tokens), op.num_steps) for op in ops
                     if isinstance(op, ExtendPropose)]
        return await super().step(ops, timeout, meanwhile)


def serve_one(req: GenerationRequest) -> tuple[list[int], LoggingTarget, LoggingDraft]:
    """One request through a scheduler with the logging stubs: its tokens and what each was asked."""
    async def main() -> tuple[list[int], LoggingTarget, LoggingDraft]:
        target, draft = LoggingTarget(), LoggingDraft()
        sched = Scheduler(target, draft, max_sequences=2, limits=Limits(max_queue=8))
        sched.draft_restored()
        sched.start()
        seq = sched.submit(req)
        tokens: list[int] = []
        while not isinstance(ev := await seq.events.get(), Finished):
            tokens += ev
        await sched.stop()
        return tokens, target, draft

    return asyncio.run(main())


def test_dormant_cycles_capture_nothing_and_call_no_draft_until_a_probe_wakes_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # fixed costs, whatever this machine's speed: a cycle without drafts 1 ms, a draft step 10 ms
    # more, a resync 60 ms; probes may lose half the time: a wake every 160 cycles or so
    monkeypatch.setattr(adaptive, "PROBE_SHARE", 0.5)
    monkeypatch.setattr(CostModel, "cycle_ms", lambda self, batch, shape: 1.0 + 10.0 * shape.steps)
    monkeypatch.setattr(CostModel, "resync_ms", lambda self, tokens: 60.0)
    monkeypatch.setattr(StepChooser, "starts_dormant", lambda self, s, batch: False)  # it rests after its cycles

    tokens, target, draft = serve_one(adaptive_request([5] * 40, max_new=1000))
    assert tokens == [9] * 1000
    dormant = [i for i, (kind, _, capture) in enumerate(target.log) if kind == "Verify" and not capture]
    recaptures = [i for i, (kind, _, _) in enumerate(target.log) if kind == "Recapture"]
    assert len(dormant) > 600  # most cycles, once it rests
    assert recaptures and recaptures[0] > dormant[0]  # woken by a probe after resting
    # woken: the draft restarts from position 0 (over what the recapture returned) at the probe's depth
    restarts = [entry for entry in draft.log if entry[1] == 0]
    assert len(restarts) == 1 + len(recaptures)  # the prompt's, then one per wake
    assert all(steps == PROBE_EXTRA for _, _, _, steps in restarts[1:])
    # every draft call of a dormant stretch: none (between going dormant and the next wake)
    assert len(draft.log) < 1000 // 8


@pytest.mark.parametrize("draft_step_ms", [10.0, 0.01])
def test_a_newcomer_starts_dormant_where_drafting_does_not_pay(monkeypatch: pytest.MonkeyPatch,
                                                               draft_step_ms: float) -> None:
    """Once the costs are measured, a request whose best plan drafts nothing (a draft step ten times
    a cycle without one) prefills without features and never calls the draft before a wake; where
    drafting pays, it drafts from its first cycle."""
    monkeypatch.setattr(CostModel, "cycle_ms", lambda self, batch, shape: 1.0 + draft_step_ms * shape.steps)
    monkeypatch.setattr(CostModel, "resync_ms", lambda self, tokens: 60.0)

    tokens, target, draft = serve_one(adaptive_request([5] * 40, max_new=48))
    assert tokens == [9] * 48
    prefill = [capture for kind, _, capture in target.log if kind == "Prefill"]
    if draft_step_ms > 1:
        assert prefill == [False] and not draft.log
        assert all(not capture for kind, _, capture in target.log if kind == "Verify")
    else:
        assert prefill == [True] and draft.log and draft.log[0][3] > 0


def test_a_newcomer_that_asked_for_speculation_never_starts_dormant() -> None:
    chooser = priced(draft_step_ms=10.0, verify_row_ms=1.0, decode_ms=1.0)  # drafting does not pay
    chooser.costs.record_prefill(64, 2.0)
    assert chooser.starts_dormant(Sequence(1, adaptive_request([1] * 10)), 1)
    assert not chooser.starts_dormant(Sequence(2, adaptive_request([1] * 10, min_steps=1)), 1)
    assert not StepChooser(8).starts_dormant(Sequence(3, adaptive_request([1] * 10)), 1)  # nothing measured


def log_target_ops(engines: LocalEngines) -> list[str]:
    """What the target is asked, op by op (a Verify that captures nothing: 'Verify-'), from now on."""
    seen: list[str] = []
    step = engines.target.step

    def logged(ops: list[TargetOp], releases: list[int]) -> Any:
        seen.extend(type(op).__name__ + ("-" if isinstance(op, Verify) and not op.capture else "") for op in ops)
        return step(ops, releases)

    engines.target.step = logged  # type: ignore[method-assign]
    return seen


PROMPTS = [[1, 2, 3], [7] * 20, [100, 42, 17, 250, 3, 3, 9], list(range(10, 60))]


def check_lossless_through_wakes(engines: LocalEngines, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy output equals target-only output while sequences rest, wake (recapture, restart the
    draft at position 0, probe) and rest again; the ring's rows all come back. The costs are fixed
    (a draft step a hundred times a cycle without one, a wake free) and probes have credit to
    spare, so that plans draft nothing and wakes come as often as the cadence allows, whatever
    this machine's speed."""
    monkeypatch.setattr(adaptive, "DORMANT_AFTER", 3)
    monkeypatch.setattr(adaptive, "PROBE_EVERY", 2)
    monkeypatch.setattr(adaptive, "PROBE_SHARE", 100.0)
    monkeypatch.setattr(CostModel, "cycle_ms", lambda self, batch, shape: 1.0 + 100.0 * shape.steps)
    monkeypatch.setattr(CostModel, "resync_ms", lambda self, tokens: 0.0)
    monkeypatch.setattr(StepChooser, "settle", lambda self, cycle_ms: None)  # probes charged as expected
    base = engines.generate([GenerationRequest(p, 60, Sampling(), {511}, 0) for p in PROMPTS])
    seen = log_target_ops(engines)
    out = engines.generate([adaptive_request(p, max_new=60) for p in PROMPTS])
    assert [r.tokens for r in out] == [b.tokens for b in base]
    assert seen.count("Verify-") >= 4 and seen.count("Recapture") >= 2, sorted(set(seen))
    stats = engines.target.stats()
    assert stats["active_sequences"] == 0 and stats["ring_rows_in_use"] == 0


def test_dormant_sequences_stay_lossless(tiny_engines: LocalEngines, monkeypatch: pytest.MonkeyPatch) -> None:
    check_lossless_through_wakes(tiny_engines, monkeypatch)


@pytest.mark.gpu
@needs_gpus(1)
def test_dormant_sequences_stay_lossless_on_the_gpu(tiny_target: Path, tiny_head: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 on the GPU: the fused target step, CUDA IPC, the draft's graphs restarted at position 0."""
    engines = LocalEngines(TargetConfig(model=str(tiny_target), device="cuda", dtype="float32", max_context=256,
                                        hidden_backend="cuda_ipc", fused_decode="pdl"),
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), device="cuda", dtype="float32",
                                       max_context=256))
    try:
        check_lossless_through_wakes(engines, monkeypatch)
    finally:
        engines.close()


def test_credit_saved_over_a_long_stretch_pays_for_no_burst_of_wakes() -> None:
    """Wakes priced at five cycles each come about once every 5 / PROBE_SHARE cycles, however long
    the credit was saved before."""
    chooser = priced(draft_step_ms=1.0, verify_row_ms=0.5, decode_ms=1.0)
    zero_ms = chooser.costs.cycle_ms(1, NO_DRAFT)
    assert zero_ms is not None
    chooser.costs.record_prefill(1024, 2.5 * zero_ms)  # a resync: 5 cycles (the extend priced as the prefill)
    for _ in range(20_000):  # a long stretch of cycles without a probe
        chooser._accrue(adaptive.PROBE_SHARE, zero_ms)
    held = adaptive.CREDIT_CYCLES * adaptive.PROBE_SHARE * zero_ms
    assert chooser.probe_credit <= held + 1e-9
    s = Sequence(1, adaptive_request([1]))
    s.committed = 100
    wakes = []
    for cycle in range(2000):
        s.dormant = True  # back to sleep at once
        if chooser.wake([s], 1, planned=False) is s:
            wakes.append(cycle)
    assert 2 <= len(wakes) <= 1 + (2000 * adaptive.PROBE_SHARE * zero_ms + held) / (5 * zero_ms)
    assert all(len([w for w in wakes if at <= w < at + 100]) <= 2 for at in range(2000))  # no burst
