"""Prompts prefilled in parts (the gateway's --prefill-chunk): the running sequences go on between
the parts, and the tokens are those of the prompt prefilled whole; the engine's side is in
test_target_engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.scheduler_cpu import InstantDraft, InstantTarget
from gateway.config import GatewayConfig
from gateway.scheduler import Finished, GenerationRequest, Limits, Scheduler
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.ops import Code, ExtendPropose, HiddenRef, Prefill, Recapture, Release, Sampling, TargetOp, Verify


class PartsTarget(InstantTarget):
    """Logs each call's prefills as (sequence, start, tokens, more) and the sequences it verifies."""

    def __init__(self) -> None:
        super().__init__(accept=False)
        self.log: list[tuple[list[tuple[int, int, int, bool]], list[int]]] = []

    async def step(self, ops: list[TargetOp], releases: list[int], timeout: float = 0.0, meanwhile: object = None
                   ) -> tuple[list, object]:
        self.log.append(([(op.seq_id, op.start, len(op.prompt_ids), op.more) for op in ops if isinstance(op, Prefill)],
                           [op.seq_id for op in ops if isinstance(op, Verify)]))
        return await super().step(ops, releases, timeout, meanwhile)  # type: ignore[arg-type]


@pytest.mark.quick
def test_a_long_prompt_goes_in_parts_while_the_running_sequences_go_on() -> None:
    """8 prompt tokens a call: a 3-token prompt and a 30-token one admitted together take 3 + 5,
    then the long one 8, 8, 8 and 1 over four more calls, each beside the short one's verify; its
    first token comes with its last part."""
    async def main() -> tuple[list[list[int]], PartsTarget, list[int]]:
        target = PartsTarget()
        sched = Scheduler(target, InstantDraft(), max_sequences=4, limits=Limits(max_queue=8, prefill_chunk=8))
        sched.draft_restored()
        short = sched.submit(GenerationRequest([5, 6, 7], 12, Sampling(), set(), 0))
        long = sched.submit(GenerationRequest(list(range(10, 40)), 4, Sampling(), set(), 0))
        sched.start()
        out = []
        for seq in (short, long):
            tokens: list[int] = []
            while not isinstance(ev := await seq.events.get(), Finished):
                tokens += ev  # type: ignore[operator]
            out.append(tokens)
        await sched.stop()
        return out, target, [short.seq_id, long.seq_id]

    (short_tokens, long_tokens), target, (short, long) = asyncio.run(main())
    assert len(short_tokens) == 12 and len(long_tokens) == 4
    parts = [(p, verifies) for prefills, verifies in target.log for p in prefills if p[0] == long]
    assert [p[1:] for p, _ in parts] == [(0, 5, True), (5, 8, True), (13, 8, True), (21, 8, True), (29, 1, False)]
    assert target.log[0][0] == [(short, 0, 3, False), (long, 0, 5, True)]
    assert all(verifies == [short] for _, verifies in parts[1:])  # the short one went on at every part


class FeatureTarget(PartsTarget):
    """Each prefill's features as rows of its own: the reference's offset is the part's start."""

    async def step(self, ops: list[TargetOp], releases: list[int], timeout: float = 0.0, meanwhile: object = None
                   ) -> tuple[list, object]:
        results, timing = await super().step(ops, releases, timeout, meanwhile)
        for op, r in zip([op for op in ops if isinstance(op, Prefill | Verify | Recapture)], results, strict=True):
            if isinstance(op, Prefill):
                r.hidden = HiddenRef(op.start, len(op.prompt_ids), r.hidden.generation)
        return results, timing


class ExtendLog(InstantDraft):
    def __init__(self) -> None:
        super().__init__()
        self.extends: list[ExtendPropose] = []

    async def step(self, ops: list, timeout: float = 0.0, meanwhile: object = None) -> tuple[list, object]:
        self.extends += [op for op in ops if isinstance(op, ExtendPropose)]
        return await super().step(ops, timeout, meanwhile)  # type: ignore[arg-type]


@pytest.mark.quick
def test_the_draft_extends_a_prompt_in_parts_once_whole_with_each_position_paired_to_the_next_token() -> None:
    """A 20-token prompt in parts of 8, 8 and 4, speculating: no extend until the last part; then
    one extend from position 0 of the prompt's tokens 1..19 and the first generated token, reading
    the three parts' features in order."""
    async def main() -> tuple[ExtendLog, list[int]]:
        draft = ExtendLog()
        sched = Scheduler(FeatureTarget(), draft, max_sequences=2, limits=Limits(max_queue=8, prefill_chunk=8))
        sched.draft_restored()
        seq = sched.submit(GenerationRequest(list(range(10, 30)), 3, Sampling(), set(), 2))
        sched.start()
        tokens: list[int] = []
        while not isinstance(ev := await seq.events.get(), Finished):
            tokens += ev  # type: ignore[operator]
        await sched.stop()
        return draft, tokens

    draft, tokens = asyncio.run(main())
    first = draft.extends[0]
    assert first.tokens == [*range(11, 30), tokens[0]] and first.position == 0
    assert [(r.offset, r.rows) for r in [*first.earlier, first.hidden]] == [(0, 8), (8, 8), (16, 4)]


def test_the_flag_is_checked() -> None:
    with pytest.raises(ValueError, match="prefill_chunk"):
        GatewayConfig(prefill_chunk=-1).validate()


def test_the_services_give_the_same_tokens_for_a_prompt_in_parts(tiny_target: Path, tiny_head: Path,
                                                                  tmp_path: Path) -> None:
    """A 40-token prompt through the three services, prefilled whole and 7 tokens a call, with
    speculation off and with 3-step chains (the draft extends the parts' features once the prompt
    is whole), greedy: the same tokens every time, and a short prompt beside it unchanged; with
    chains, as many cycles either way."""
    long_prompt = [(7 * i + 3) % 500 + 1 for i in range(40)]
    got, cycles = [], []
    for chunk in ("0", "7"):
        cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=256, log_dir=tmp_path / chunk,
                             extra_gateway_args=["--prefill-chunk", chunk])
        with ServiceStack(cfg) as s:
            c = GatewayClient(s.addr("gateway"))
            try:
                for spec in (False, True):
                    steps = {"num_steps": 3} if spec else {"speculation": False}
                    for prompt in (long_prompt, [5, 6, 7]):
                        gen = c.generate(make_request(token_ids=prompt, max_new_tokens=24, ignore_eos=True, **steps))
                        got.append(((chunk, spec, len(prompt)), gen.token_ids))
                        if spec:
                            cycles.append(gen.final.speculation.cycles)
            finally:
                c.close()
    by_prompt: dict[int, set[tuple[int, ...]]] = {}
    for (_, _, n), tokens in got:
        assert len(tokens) == 24
        by_prompt.setdefault(n, set()).add(tuple(tokens))
    assert all(len(v) == 1 for v in by_prompt.values()), got
    assert cycles[:2] == cycles[2:]


@pytest.mark.quick
def test_a_prompt_goes_in_at_most_as_many_parts_as_one_extend_reads() -> None:
    """One token a call would make 200 parts of a 200-token prompt: parts of ceil(200 / 65) = 4."""
    async def main() -> PartsTarget:
        target = PartsTarget()
        sched = Scheduler(target, InstantDraft(), max_sequences=2, limits=Limits(max_queue=8, prefill_chunk=1))
        seq = sched.submit(GenerationRequest(list(range(1, 201)), 2, Sampling(), set(), 0))
        sched.start()
        while not isinstance(await seq.events.get(), Finished):
            pass
        await sched.stop()
        return target

    parts = [p for prefills, _ in asyncio.run(main()).log for p in prefills]
    assert [p[2] for p in parts] == [4] * 50 and parts[-1][3] is False


class RingFullOnce(FeatureTarget):
    """Refuses the first part after a prompt's first for want of ring space, once; logs each
    prefill's capture and each recapture."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = False
        self.captures: list[tuple[int, bool]] = []
        self.recaptures = 0

    async def step(self, ops: list[TargetOp], releases: list[int], timeout: float = 0.0, meanwhile: object = None
                   ) -> tuple[list, object]:
        self.captures += [(op.start, op.capture) for op in ops if isinstance(op, Prefill)]
        self.recaptures += sum(isinstance(op, Recapture) for op in ops)
        results, timing = await super().step(ops, releases, timeout, meanwhile)
        for op, r in zip([op for op in ops if isinstance(op, Prefill | Verify | Recapture)], results, strict=True):
            if isinstance(op, Prefill) and op.start and not self.refused:
                self.refused = True
                r.code, r.message, r.tokens, r.hidden = Code.RESOURCE_EXHAUSTED, "hidden-state ring full", [], None
        return results, timing


@pytest.mark.quick
def test_a_part_refused_for_ring_space_lets_the_prompt_s_features_go_and_it_is_recaptured_when_whole() -> None:
    """Parts hold their features until the prompt is whole: a part refused for ring space frees
    the earlier parts' rows and the rest of the prompt goes without features (so prompts in
    parts never hold the ring against each other); once whole, the sequence is recaptured and
    speculates."""
    async def main() -> tuple[RingFullOnce, ExtendLog, list[int], int]:
        target, draft = RingFullOnce(), ExtendLog()
        sched = Scheduler(target, draft, max_sequences=2, limits=Limits(max_queue=8, prefill_chunk=8))
        sched.draft_restored()
        seq = sched.submit(GenerationRequest(list(range(10, 30)), 6, Sampling(), set(), 2))
        sched.start()
        tokens: list[int] = []
        while not isinstance(ev := await seq.events.get(), Finished):
            tokens += ev  # type: ignore[operator]
        await sched.stop()
        return target, draft, tokens, len(sched.free_generations)

    target, draft, tokens, _ = asyncio.run(main())
    assert target.captures == [(0, True), (8, True), (8, False), (16, False)]  # refused at 8, then retried without
    assert target.recaptures == 1 and len(tokens) == 6
    assert draft.extends and draft.extends[0].position == 0  # the recaptured features, from position 0


def test_each_cycle_of_a_prompt_in_parts_is_a_prefill_span() -> None:
    from gateway.observe import CycleSpans
    from gateway.scheduler import Sequence

    class Log:
        records: list[tuple] = []

        def record(self, rec: tuple) -> None:
            self.records.append(rec)

    spans = CycleSpans(Log())  # type: ignore[arg-type]
    parted, running = (Sequence(i, GenerationRequest([1, 2], 4, Sampling(), set(), 0)) for i in (1, 2))
    running.prefilled = True
    for s in (parted, running):
        s.trace_ids = (7, 8, "00-" + "0" * 31 + "7-")
    spans.close(spans.open([parted, running], []))  # a later cycle: neither is a newcomer
    assert [(r[0], r[8]["spec.cycle"]) for r in Log.records] == [("prefill", 0), ("cycle", 1)]


class ReleaseLog(PartsTarget):
    """Logs the releases; cancels `victim` once its first part is in."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[int] = []
        self.sched: Scheduler | None = None
        self.victim = None

    async def step(self, ops: list[TargetOp], releases: list[int], timeout: float = 0.0, meanwhile: object = None
                   ) -> tuple[list, object]:
        self.released += [op.seq_id for op in ops if isinstance(op, Release)]
        out = await super().step(ops, releases, timeout, meanwhile)
        if self.victim is not None and any(p[0] == self.victim.seq_id for p in self.log[-1][0]):
            self.sched.cancel(self.victim)  # type: ignore[union-attr]
            self.victim = None
        return out


@pytest.mark.quick
def test_a_stream_cancelled_halfway_through_its_prompt_releases_its_slot() -> None:
    async def main() -> tuple[ReleaseLog, int, list[int]]:
        target = ReleaseLog()
        sched = Scheduler(target, InstantDraft(), max_sequences=2, limits=Limits(max_queue=8, prefill_chunk=8))
        target.sched = sched
        seq = sched.submit(GenerationRequest(list(range(10, 40)), 4, Sampling(), set(), 0))
        target.victim = seq
        other = sched.submit(GenerationRequest([5, 6, 7], 6, Sampling(), set(), 0))
        sched.start()
        ends = []
        for s in (seq, other):
            while not isinstance(ev := await s.events.get(), Finished):
                pass
            ends.append(ev.reason)
        for _ in range(5):  # the cancel's release goes with the next call
            await asyncio.sleep(0.01)
        await sched.stop()
        return target, seq.seq_id, ends

    target, victim, ends = asyncio.run(main())
    assert ends == ["abort", "length"] and victim in target.released
    assert [p[1:] for prefills, _ in target.log for p in prefills if p[0] == victim] == [(0, 8, True)]
