"""Prompts prefilled in parts (the gateway's --prefill-chunk): the running sequences go on between
the parts, and the tokens are those of the prompt prefilled whole; the engine's side is in
test_target_engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.scheduler_cpu import InstantDraft, InstantTarget
from gateway.config import GatewayConfig
from gateway.scheduler import Finished, GenerationRequest, Limits, Scheduler, Sequence
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


def serve(target: InstantTarget, draft: InstantDraft, requests: list[GenerationRequest], chunk: int, slots: int = 4,
          prepare: Callable[[Scheduler, list[Sequence]], None] | None = None
          ) -> tuple[list[tuple[list[int], str]], list[Sequence]]:
    """The requests through a scheduler on these stubs, `chunk` prompt tokens a call -> each one's
    tokens and finish reason, and its sequence (`prepare` sees them before the loop starts)."""
    async def main() -> tuple[list[tuple[list[int], str]], list[Sequence]]:
        sched = Scheduler(target, draft, max_sequences=slots, limits=Limits(max_queue=8, prefill_chunk=chunk))
        sched.draft_restored()
        seqs = [sched.submit(r) for r in requests]
        if prepare is not None:
            prepare(sched, seqs)
        sched.start()
        out = []
        for seq in seqs:
            tokens: list[int] = []
            while not isinstance(ev := await seq.events.get(), Finished):
                tokens += ev  # type: ignore[operator]
            out.append((tokens, ev.reason))
        await asyncio.sleep(0.05)  # what the last cycle left (a release) goes with the next call
        await sched.stop()
        return out, seqs

    return asyncio.run(main())


@pytest.mark.quick
def test_a_long_prompt_goes_in_parts_while_the_running_sequences_go_on() -> None:
    """8 prompt tokens a call: a 3-token prompt and a 30-token one admitted together take 3 + 5,
    then the long one 8, 8, 8 and 1 over four more calls, each beside the short one's verify; its
    first token comes with its last part."""
    target = PartsTarget()
    ((short_tokens, _), (long_tokens, _)), seqs = serve(
        target, InstantDraft(), [GenerationRequest([5, 6, 7], 12, Sampling(), set(), 0),
                                 GenerationRequest(list(range(10, 40)), 4, Sampling(), set(), 0)], chunk=8)
    short, long = (seq.seq_id for seq in seqs)
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
    draft = ExtendLog()
    ((tokens, _),), _ = serve(FeatureTarget(), draft, [GenerationRequest(list(range(10, 30)), 3, Sampling(), set(), 2)],
                              chunk=8, slots=2)
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
    target = PartsTarget()
    serve(target, InstantDraft(), [GenerationRequest(list(range(1, 201)), 2, Sampling(), set(), 0)], chunk=1, slots=2)
    parts = [p for prefills, _ in target.log for p in prefills]
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
    target, draft = RingFullOnce(), ExtendLog()
    ((tokens, _),), _ = serve(target, draft, [GenerationRequest(list(range(10, 30)), 6, Sampling(), set(), 2)],
                              chunk=8, slots=2)
    assert target.captures == [(0, True), (8, True), (8, False), (16, False)]  # refused at 8, then retried without
    assert target.recaptures == 1 and len(tokens) == 6
    assert draft.extends and draft.extends[0].position == 0  # the recaptured features, from position 0


def test_each_cycle_of_a_prompt_in_parts_is_a_prefill_span() -> None:
    from gateway.observe import CycleSpans
    from gateway.outbox import Outbox

    class Log:
        records: list[tuple] = []

        def record(self, rec: tuple) -> None:
            self.records.append(rec)

    spans = CycleSpans(Log())  # type: ignore[arg-type]
    parted, running = (Sequence(i, GenerationRequest([1, 2], 4, Sampling(), set(), 0)) for i in (1, 2))
    running.prefilled = True
    for s in (parted, running):
        s.trace_ids = (7, 8, "00-" + "0" * 31 + "7-")
    outbox = Outbox()
    spans.close(spans.open([parted, running], []), outbox)  # a later cycle: neither is a newcomer
    outbox.deliver()  # (recorded with the cycle's bookkeeping)
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
    target = ReleaseLog()

    def prepare(sched: Scheduler, seqs: list[Sequence]) -> None:
        target.sched, target.victim = sched, seqs[0]

    out, seqs = serve(target, InstantDraft(), [GenerationRequest(list(range(10, 40)), 4, Sampling(), set(), 0),
                                               GenerationRequest([5, 6, 7], 6, Sampling(), set(), 0)],
                      chunk=8, slots=2, prepare=prepare)
    ends, victim = [end for _, end in out], seqs[0].seq_id
    assert ends == ["abort", "length"] and victim in target.released
    assert [p[1:] for prefills, _ in target.log for p in prefills if p[0] == victim] == [(0, 8, True)]
