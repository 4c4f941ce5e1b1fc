"""Draft steps chosen per cycle (gateway.adaptive): the choice follows measured costs and
acceptance, and greedy output stays the target's own, in process and over gRPC."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from bench.replay import ReplayDraft, Replayer
from bench.scheduler_cpu import InstantDraft, InstantTarget
from draft_service.config import DraftConfig
from gateway import adaptive
from gateway.adaptive import EARLY_CYCLES, PROBE_EVERY, PROBE_SHARE, REPLAN, Choice, StepChooser
from gateway.clients import LocalDraft, Meanwhile
from gateway.costs import CostModel, DepthAcceptance, Shape
from gateway.local import LocalEngines
from gateway.phases import DraftDeadline
from gateway.scheduler import Finished, Limits, Scheduler
from gateway.sequence import GenerationRequest, Sequence
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.ops import DraftOp, DraftResult, ExtendPropose, HiddenRef, Sampling, StepTiming
from target_service.config import TargetConfig
from tests.test_gpu_services import needs_gpus

PROMPTS = [[1, 2, 3], [7] * 20, [100, 42, 17, 250, 3, 3, 9], list(range(10, 60))]


def adaptive_request(ids: list[int], max_new: int = 40, topk: int = 1, min_steps: int = 0) -> GenerationRequest:
    return GenerationRequest(ids, max_new, Sampling(), {511}, 3, topk, 8 if topk > 1 else 0, adaptive=True,
                             min_steps=min_steps)


def priced(draft_step_ms: float, verify_row_ms: float, decode_ms: float = 10.0) -> StepChooser:
    """A chooser whose costs were measured at two shapes: a draft call of 0.5 + step x steps ms,
    a verify of decode + row x (rows - 1) ms."""
    chooser = StepChooser(8)
    for steps in (0, 4):
        chooser.costs.record_draft(1, 1, steps, 0.5 + draft_step_ms * steps)
        chooser.costs.record_verify(1, steps + 1, decode_ms + verify_row_ms * steps)
    return chooser


def taught(chooser: StepChooser, req: GenerationRequest, accepted: int, cycles: int = 30) -> Sequence:
    """A sequence whose drafts of 8 were accepted `accepted` deep every cycle."""
    s = Sequence(1, req)
    for _ in range(cycles):
        chooser.observe(s, Shape.chain(8), accepted)
    s.stats.cycles = PROBE_EVERY  # not a probing cycle
    return s


def test_depth_acceptance_counts_only_depths_reached() -> None:
    acc = DepthAcceptance(8, decay=1.0)
    acc.observe(steps=5, accepted=2)  # depths 1, 2 accepted, 3 rejected, 4 and 5 never tried
    assert acc.trials[1:6] == [1, 1, 1, 0, 0] and acc.accepts[1:6] == [1, 1, 0, 0, 0]
    acc.observe(steps=3, accepted=3)  # all three accepted: depth 4 was not drafted
    assert acc.trials[1:5] == [2, 2, 2, 0] and acc.rate(3, prior=0.5, weight=2.0) == pytest.approx(2 / 4)
    decayed = DepthAcceptance(2, decay=0.5)
    decayed.observe(steps=1, accepted=0)
    decayed.observe(steps=1, accepted=1)  # the first observation now weighs 0.5: 1 of 1.5 accepted
    assert decayed.rate(1, prior=0.0, weight=1.0) == pytest.approx(1 / 2.5)
    for _ in range(40):  # rescaled on the way: the same rate as decayed in place
        decayed.observe(steps=1, accepted=1)
    assert decayed.rate(1, prior=0.0, weight=1.0) == pytest.approx(2 / 3, abs=1e-6)


def test_costs_take_measured_points_and_a_line_elsewhere() -> None:
    costs = CostModel()
    assert costs.cycle_ms(1, Shape.chain(3)) is None  # nothing measured: no price
    costs.record_draft(1, 1, 2, 3.0)
    costs.record_draft(1, 1, 4, 5.0)
    costs.record_verify(1, 3, 10.0)
    assert costs.cycle_ms(1, Shape.chain(2)) == pytest.approx(13.0)
    assert costs.cycle_ms(1, Shape.chain(6)) == pytest.approx(7.0 + 10.0)  # the draft's line, the verify's one point
    costs.record_rest(1, 1.0)
    assert costs.cycle_ms(2, Shape.chain(2)) == pytest.approx(14.0)  # the nearest batch size measured
    assert costs.cycle_ms(1, Shape.chain(0)) == pytest.approx(10.0 + 1.0)  # no cycle without a draft call yet
    costs.record_rest(1, 0.25, drafted=False)  # one call's transport, not two
    assert costs.cycle_ms(1, Shape.chain(0)) == pytest.approx(10.0 + 0.25)
    assert costs.cycle_ms(1, Shape.chain(2)) == pytest.approx(14.0)
    costs.record_draft(1, 1, 2, 100.0)  # a CUDA graph captured: not a cost
    assert costs.draft[1][1][2] == 3.0
    costs.record_draft(1, 1, 8, 100.0)  # a first call that captured
    costs.record_draft(1, 1, 8, 9.0)  # the shape's real cost replaces it
    assert costs.draft[1][1][8] == 9.0


def test_a_verify_of_many_rows_is_not_priced_as_decoding_ahead() -> None:
    """At a batch size where only speculation off was measured, a speculative verify is priced
    from a one-token call plus the rows' growth at the nearest batch that verified several rows,
    never from decoding ahead's cheap share of a call; a cycle that drafts nothing is priced
    at that share."""
    costs = CostModel()
    costs.record_draft(1, 1, 3, 0.6)
    costs.record_verify(1, 1, 0.45)
    costs.record_verify(1, 4, 0.8)  # batch 1 drafted: 3 more rows cost 0.35
    costs.record_verify(4, 1, 0.9)  # batch 4: speculation off, a token a call
    costs.record_decode(4, 0.2)  # ... and decoding ahead, a token's share of a call
    assert costs.verify_ms(4, 4) == pytest.approx(0.9 + 0.35)
    assert costs.cycle_ms(4, Shape.chain(3)) == pytest.approx(0.6 + 0.9 + 0.35)
    assert costs.cycle_ms(4, Shape.chain(0)) == pytest.approx(0.2)
    assert costs.token_ms(4) == pytest.approx(0.2) and costs.verify[4] == {1: 0.9}


def test_no_acceptance_means_no_speculation() -> None:
    chooser = priced(draft_step_ms=1.0, verify_row_ms=0.5)
    s = taught(chooser, adaptive_request([1]), accepted=0)
    choice = chooser.choose(s, 1)
    assert choice.shape == Shape.chain(0) and choice.reason == "best"


def test_a_request_that_asked_for_speculation_drafts_at_least_one_step() -> None:
    chooser = priced(draft_step_ms=1.0, verify_row_ms=0.5)
    s = taught(chooser, adaptive_request([1], min_steps=1), accepted=0)
    assert chooser.choose(s, 1).shape == Shape.chain(1)


def test_cheap_verifies_and_high_acceptance_draft_deep() -> None:
    chooser = priced(draft_step_ms=0.1, verify_row_ms=0.0)  # a GPU: verifying 9 rows costs a decode
    s = taught(chooser, adaptive_request([1]), accepted=8)
    assert chooser.choose(s, 1).shape == Shape.chain(8)


def test_costly_verifies_stop_short() -> None:
    """Rows that cost as much as a decode (a CPU) pay only while acceptance is near certain."""
    chooser = priced(draft_step_ms=0.5, verify_row_ms=10.0)
    s = taught(chooser, adaptive_request([1]), accepted=8)
    shape = chooser.choose(s, 1).shape
    assert shape.steps == 0  # 1 token / 10.5 ms beats (1 + k) tokens / ((1 + k) 10 + ...) ms


def test_moderate_acceptance_picks_an_interior_depth() -> None:
    chooser = priced(draft_step_ms=1.0, verify_row_ms=1.0)
    s = taught(chooser, adaptive_request([1]), accepted=2)
    assert 1 <= chooser.choose(s, 1).shape.steps <= 4


def run_cycles(chooser: StepChooser, s: Sequence, cycles: int) -> list[Choice]:
    out = []
    for _ in range(cycles):
        out.append(chooser.choose(s, 1))
        s.stats.cycles += 1
    return out


def test_cheap_probes_go_past_the_choice_every_few_cycles() -> None:
    """Drafting costs little (a CPU-like profile): probes follow the cadence, PROBE_EVERY cycles
    apart (twice as often in the first EARLY_CYCLES)."""
    chooser = priced(draft_step_ms=0.1, verify_row_ms=0.1)
    s = taught(chooser, adaptive_request([1]), accepted=1)
    s.stats.cycles = 0
    choices = run_cycles(chooser, s, EARLY_CYCLES + 4 * PROBE_EVERY)
    best = choices[0].shape
    probes = [i for i, c in enumerate(choices) if c.reason == "probe"]
    assert all(choices[i].shape == Shape.chain(best.steps + 2) for i in probes)
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert probes[0] == PROBE_EVERY // 2 - 1 and set(gaps) == {PROBE_EVERY // 2, PROBE_EVERY}


def test_costly_probes_stay_within_their_share_of_the_time() -> None:
    """Drafting costs several decodes (a small target on a GPU) and nothing is accepted: the best
    choice is no speculation, and what probes lose against it stays within PROBE_SHARE of the
    time (twice that in the first EARLY_CYCLES), yet they still happen."""
    chooser = priced(draft_step_ms=3.0, verify_row_ms=1.0, decode_ms=1.0)
    s = taught(chooser, adaptive_request([1]), accepted=0)
    s.stats.cycles = 0
    choices = run_cycles(chooser, s, 1000)
    best_ms = next(c.expected_ms for c in choices if c.reason == "best")
    assert all(c.shape.steps == 0 for c in choices if c.reason == "best")
    probes = [c for c in choices if c.reason == "probe"]
    assert probes and all(c.shape == Shape.chain(2) for c in probes)
    lost = sum(c.expected_ms - c.expected_tokens * best_ms for c in probes)  # the best emits 1 token a best_ms
    assert lost <= PROBE_SHARE * (1000 + EARLY_CYCLES) * best_ms
    assert len(probes) < 1000 / (4 * PROBE_EVERY)  # rarer than the cadence


def batch_priced(batch: int, verify_ms: dict[int, float], draft_ms: float = 1.0) -> StepChooser:
    """A chooser whose costs at `batch` were measured: a verify of `rows` a sequence takes
    verify_ms[rows] (a line elsewhere), a draft call 0.2 + draft_ms x steps."""
    chooser = StepChooser(8)
    for steps in (1, 4):
        chooser.costs.record_draft(batch, 1, steps, 0.2 + draft_ms * steps)
    for rows, ms in verify_ms.items():
        chooser.costs.record_verify(batch, rows, ms)
    return chooser


def test_one_plan_for_the_batch_weighs_what_each_sequence_gains() -> None:
    """Eight sequences share a cycle: a draft for one makes all eight wait for it. One sequence
    that accepts everything does not make the batch draft while the others accept nothing; when
    most accept, the whole batch drafts, all to the same depth."""
    chooser = batch_priced(8, {1: 2.0, 5: 3.0, 9: 4.0})
    seqs = [taught(chooser, adaptive_request([1]), accepted=0) for _ in range(8)]
    for s, i in zip(seqs, range(8), strict=True):
        s.seq_id = i
    seqs[0].acceptance.clear()
    for _ in range(30):
        chooser.observe(seqs[0], Shape.chain(8), 8)
    assert chooser.expected_tokens(seqs[0], Shape.chain(4)) > 4  # alone, it would draft 4 or more
    assert chooser.choose(seqs[0], 8).shape.steps >= 4
    chooser.cycles = chooser.probed_at = 0  # no probe in the next choices
    choices = chooser.choose_batch(seqs, 8)
    assert {c.shape for c in choices} == {Shape.chain(0)} and {c.reason for c in choices} == {"best"}
    for s in seqs[1:6]:  # most of the batch now accepts everything
        s.acceptance.clear()
        for _ in range(30):
            chooser.observe(s, Shape.chain(8), 8)
    chooser.cycles += REPLAN  # the plan is made again for new observations every REPLAN cycles
    chooser.probed_at = chooser.cycles
    choices = chooser.choose_batch(seqs, 8)
    assert len({c.shape for c in choices}) == 1 and choices[0].shape.steps >= 4


def test_a_fixed_shape_in_the_batch_lets_adaptive_ones_draft_as_deep_for_free() -> None:
    """A request of a fixed shape makes the batch draft and verify 5 rows anyway: the plan
    prices its own shapes at that floor, so a moderately accepting batch drafts that deep."""
    chooser = batch_priced(2, {1: 1.0, 5: 3.0, 9: 5.0}, draft_ms=0.5)
    s = taught(chooser, adaptive_request([1]), accepted=1)
    chooser.probed_at = chooser.cycles = 0
    alone = chooser.choose_batch([s], 2)[0].shape
    chooser.probed_at = chooser.cycles
    beside = chooser.choose_batch([s], 2, floor=Shape.chain(4))[0].shape
    assert alone.steps == 0 and beside.steps >= 2


def test_probes_are_made_by_the_whole_batch_at_once() -> None:
    chooser = batch_priced(4, {1: 1.0, 3: 1.1, 5: 1.2}, draft_ms=0.05)
    seqs = [taught(chooser, adaptive_request([1]), accepted=1) for _ in range(4)]
    for i, s in enumerate(seqs):
        s.seq_id, s.stats.cycles = i, 0
    rounds = [chooser.choose_batch(seqs, 4) for _ in range(3 * PROBE_EVERY)]
    probes = [r for r in rounds if r[0].reason == "probe"]
    assert probes and all({c.reason for c in r} == {r[0].reason} and len({c.shape for c in r}) == 1 for r in rounds)
    best = next(r[0].shape for r in rounds if r[0].reason == "best")
    assert all(r[0].shape == Shape.chain(best.steps + 2) for r in probes)


def test_extends_put_off_go_out_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cycles that draft nothing put the draft's extends off; once one sequence must extend (32
    tokens wait), every put-off sequence extends in that call, so that the batch makes one draft
    call every 32 cycles rather than one for each sequence."""
    calls: list[list[tuple[int, int]]] = []

    class LoggingDraft(InstantDraft):
        async def step(self, ops: list[DraftOp], timeout: float = 0.0, meanwhile: Meanwhile = None
                       ) -> tuple[list[DraftResult], StepTiming]:
            extends = [(op.seq_id, len(op.tokens)) for op in ops if isinstance(op, ExtendPropose)]
            if extends:  # not a call of releases alone
                calls.append(extends)
            return await super().step(ops, timeout, meanwhile)

    def no_drafts(self: StepChooser, seqs: list[Sequence], batch: int, floor: Shape | None = None) -> list[Choice]:
        return [Choice(Shape.chain(0), 1.0, 1.0, "best") for _ in seqs]

    monkeypatch.setattr(StepChooser, "choose_batch", no_drafts)
    monkeypatch.setattr(adaptive, "DORMANT_AFTER", 10**6)  # none goes dormant (tests/test_dormant.py)

    async def main() -> list[list[int]]:
        sched = Scheduler(InstantTarget(), LoggingDraft(), max_sequences=4, limits=Limits(max_queue=8))
        sched.draft_restored()
        sched.start()
        seqs = [sched.submit(adaptive_request([5] * n, max_new=100)) for n in (3, 10, 20, 28)]
        out = []
        for seq in seqs:
            tokens: list[int] = []
            while not isinstance(ev := await seq.events.get(), Finished):
                tokens += ev
            out.append(tokens)
        await sched.stop()
        return out

    outs = asyncio.run(main())
    assert [len(t) for t in outs] == [100] * 4
    assert len(calls) >= 2 and all(len(call) == 4 for call in calls)  # every call extends all four
    assert len(calls) <= 100 // 32 + 1
    assert all(n >= 32 for call in calls for _, n in call if n == max(m for _, m in call))


def test_probes_that_cost_more_than_estimated_are_made_more_rarely() -> None:
    """A probe is charged its expected loss, then what its cycle measurably lost: probe cycles
    that take five times their estimate leave probes within the share of the time all the same."""

    def run(slowdown: float) -> tuple[int, float]:
        chooser = priced(draft_step_ms=3.0, verify_row_ms=1.0, decode_ms=1.0)
        s = taught(chooser, adaptive_request([1]), accepted=0)
        probes, lost = 0, 0.0
        for _ in range(2000):
            (c,) = chooser.choose_batch([s], 1)
            s.generated.append(9)  # nothing accepted: one token a cycle
            ms = c.expected_ms * (slowdown if c.reason == "probe" else 1.0)
            if c.reason == "probe":
                probes, lost = probes + 1, lost + ms - chooser._planned.ms  # type: ignore[union-attr]
            chooser.settle(ms)
            s.stats.cycles += 1
        return probes, lost

    probes, lost = run(1.0)
    slow_probes, slow_lost = run(5.0)
    share = PROBE_SHARE * (2000 + EARLY_CYCLES) * 1.0  # the best plan: a 1 ms decode a token
    assert probes > 0 and lost <= share
    assert 0 < slow_probes < probes / 3 and slow_lost <= share + 5 * lost / probes  # at most one probe over


def test_trees_are_candidates_for_a_tree_request() -> None:
    chooser = StepChooser(4)
    shapes = chooser.candidates(adaptive_request([1], topk=4))
    assert Shape.chain(0) in shapes and Shape(4, 4, 8) in shapes and Shape(1, 4, 5) in shapes
    assert all(s.tokens <= 8 for s in shapes if s.topk > 1)


def test_unmeasured_costs_draft_the_requests_own_shape() -> None:
    chooser = StepChooser(8)
    choice = chooser.choose(Sequence(1, adaptive_request([1])), 1)
    assert choice.shape == Shape.chain(3) and choice.reason == "measuring"


@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("rate", [None, 0.8])
def test_adaptive_steps_are_lossless(tiny_engines: LocalEngines, topk: int, rate: float | None) -> None:
    check_lossless(tiny_engines, topk, rate)


def check_lossless(engines: LocalEngines, topk: int, rate: float | None) -> None:
    """Greedy output equals target-only output whatever each cycle drafts, solo and batched;
    with replayed acceptance the chooser drafts more than one shape."""
    base = engines.generate([GenerationRequest(p, 40, Sampling(), {511}, 0) for p in PROMPTS])
    draft = None
    if rate is not None:
        refs = [p + b.tokens for p, b in zip(PROMPTS, base, strict=True)]
        assert engines.draft is not None
        draft = ReplayDraft(LocalDraft(engines.draft), Replayer(refs, rate, 512))
    out = engines.generate([adaptive_request(p, topk=topk) for p in PROMPTS], draft)
    assert [r.tokens for r in out] == [b.tokens for b in base]
    shapes = {sh for r in out for sh in r.stats.shapes}
    assert len(shapes) > 1
    if rate is not None:
        assert max(sh.steps for sh in shapes) >= 3
    assert engines.target.stats()["active_sequences"] == 0


@pytest.mark.gpu
@needs_gpus(1)
@pytest.mark.parametrize("topk", [1, pytest.param(4, marks=pytest.mark.quick)])
def test_adaptive_steps_are_lossless_on_the_gpu(tiny_target: Path, tiny_head: Path, topk: int) -> None:
    """fp32 on the GPU, the fused target step (chains, trees and batches of them) and CUDA IPC."""
    engines = LocalEngines(TargetConfig(model=str(tiny_target), device="cuda", dtype="float32", max_context=256,
                                        hidden_backend="cuda_ipc", fused_decode="pdl"),
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), device="cuda", dtype="float32",
                                       max_context=256))
    try:
        check_lossless(engines, topk, 0.8)
    finally:
        engines.close()


def test_adaptive_over_grpc_reports_its_choices(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=256, num_steps=3,
                         log_dir=tmp_path)
    with ServiceStack(cfg) as stack:
        client = GatewayClient(stack.addr("gateway"))
        try:
            base = client.generate(make_request(token_ids=PROMPTS[1], max_new_tokens=32, speculation=False,
                                                ignore_eos=True))
            free = client.generate(make_request(token_ids=PROMPTS[1], max_new_tokens=32, ignore_eos=True))
            fixed = client.generate(make_request(token_ids=PROMPTS[1], max_new_tokens=32, num_steps=3,
                                                 ignore_eos=True))
            sampled = client.generate(make_request(token_ids=PROMPTS[1], max_new_tokens=8, temperature=0.7,
                                                   seed=5, ignore_eos=True))
        finally:
            client.close()
    assert free.token_ids == base.token_ids == fixed.token_ids
    s = free.final.speculation
    assert s.adaptive and s.enabled and sum(s.num_steps_histogram) == s.cycles
    assert s.num_steps_histogram[s.num_steps] == max(s.num_steps_histogram)
    f = fixed.final.speculation
    assert not f.adaptive and f.num_steps == 3 and list(f.num_steps_histogram) == [0, 0, 0, f.cycles]
    assert not sampled.final.speculation.adaptive  # a seed gives the same tokens in every process


def test_adaptive_steps_can_be_turned_off(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=256, num_steps=2,
                         log_dir=tmp_path, extra_gateway_args=["--no-adaptive-steps"])
    with ServiceStack(cfg) as stack:
        client = GatewayClient(stack.addr("gateway"))
        try:
            s = client.generate(make_request(token_ids=PROMPTS[0], max_new_tokens=12)).final.speculation
        finally:
            client.close()
    assert not s.adaptive and s.num_steps == 2


def test_draft_deadline_waits_longer_for_a_shape_seen_first() -> None:
    """A draft call of a shape not seen before may take the cap (the draft captures a CUDA graph
    for it); calls of shapes seen before get 10x the p99 of measured steps, at least the floor;
    a first call's time is not measured."""
    deadline = DraftDeadline(cap_s=5.0)

    def call(batch: int, steps: int, tokens: int = 2, position: int = 100) -> list[DraftOp]:
        return [ExtendPropose(i, [1] * tokens, HiddenRef(0, tokens, 1), steps, position=position) for i in range(batch)]

    def seconds(ops: list[DraftOp]) -> float:
        return deadline.seconds(ops, DraftDeadline.shape(ops))

    def record(ops: list[DraftOp], s: float) -> None:
        deadline.record(ops, DraftDeadline.shape(ops), s)

    for _ in range(10):
        assert seconds(call(1, 3)) in (5.0, 0.05)
        record(call(1, 3), 0.002)
    assert seconds(call(1, 3)) == 0.05 and len(deadline.times) == 9
    assert seconds(call(1, 3, position=120)) == 0.05  # the same context bucket
    # the context bucket the draft captures for: 125 + 2 + 2 steps' nodes = 129 entries, past 128
    assert DraftDeadline.shape(call(1, 3, position=125))[-1] == 256
    assert DraftDeadline.shape(call(1, 3, position=124))[-1] == 128
    for new in (call(4, 3), call(1, 5), call(1, 3, tokens=3), call(1, 3, position=125)):
        assert seconds(new) == 5.0
        record(new, 0.4)  # a capture
        assert seconds(new) == 0.05 and max(deadline.times) == 0.002
