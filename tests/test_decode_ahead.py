"""Decoding ahead: cycles that draft nothing decode several tokens in one target call
(gateway.phases.decode_ahead, ModelRunner.decode); the engine's side is in test_target_engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.scheduler_cpu import InstantDraft, InstantTarget
from gateway.phases import decode_ahead
from gateway.scheduler import Finished, GenerationRequest, Limits, Scheduler, Sequence
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.models.parallel import TensorParallel
from specsplit.ops import Prefill, Sampling, TargetOp, Verify
from target_service.config import TargetConfig
from target_service.runtime import TargetRuntime
from tests.test_gpu_services import needs_gpus

AHEAD = Limits(max_queue=8, decode_ahead_ms=1000.0, decode_most=8)


class CountingTarget(InstantTarget):
    """Logs each call's verifies as (sequence, tokens it decodes)."""

    def __init__(self) -> None:
        super().__init__(accept=False)
        self.verifies: list[list[tuple[int, int]]] = []

    async def step(self, ops: list[TargetOp], releases: list[int], timeout: float = 0.0, meanwhile: object = None
                   ) -> tuple[list, object]:
        verifies = [(op.seq_id, op.decode) for op in ops if isinstance(op, Verify)]
        if verifies:
            self.verifies.append(verifies)
        return await super().step(ops, releases, timeout, meanwhile)  # type: ignore[arg-type]


def request(max_new: int, steps: int = 0, temperature: float = 0.0) -> GenerationRequest:
    return GenerationRequest([5, 6, 7], max_new, Sampling(temperature=temperature, seed=1), set(), steps)


def serve(requests: list[GenerationRequest], limits: Limits = AHEAD, slots: int = 4
          ) -> tuple[list[list[int]], CountingTarget]:
    async def main() -> tuple[list[list[int]], CountingTarget]:
        target = CountingTarget()
        sched = Scheduler(target, InstantDraft(), max_sequences=slots, limits=limits)
        sched.draft_restored()
        seqs = [sched.submit(r) for r in requests]
        sched.start()
        out = []
        for seq in seqs:
            tokens: list[int] = []
            while not isinstance(ev := await seq.events.get(), Finished):
                tokens += ev  # type: ignore[operator]
            out.append(tokens)
        await sched.stop()
        return out, target

    return asyncio.run(main())


def test_a_cycle_that_drafts_nothing_decodes_ahead_within_what_is_left() -> None:
    (tokens,), target = serve([request(29)])
    assert len(tokens) == 29
    # the first verify measures a token's cost; then powers of two up to 8, never past max_new_tokens
    assert [call[0][1] for call in target.verifies] == [1, 8, 8, 8, 2, 1]
    (greedy, sampled), target = serve([request(29), request(29, temperature=0.7)])  # sampled ones too
    assert len(greedy) == len(sampled) == 29 and max(n for call in target.verifies for _, n in call) == 8


def test_calls_that_decode_ahead_are_priced_apart_from_one_token_calls() -> None:
    """The chooser's costs: a call that decodes several tokens a sequence is recorded as a
    token's share of it (CostModel.decode), and the verify table keeps one-token calls only, from
    which verifies of several rows are priced (gateway.costs)."""
    async def main() -> Scheduler:
        sched = Scheduler(CountingTarget(), InstantDraft(), max_sequences=2, limits=AHEAD)
        sched.draft_restored()
        seq = sched.submit(request(29))
        sched.start()
        while not isinstance(await seq.events.get(), Finished):
            pass
        await sched.stop()
        return sched

    costs = asyncio.run(main()).chooser.costs
    assert set(costs.decode) == {1} and set(costs.verify) == {1} and set(costs.verify[1]) == {1}
    assert costs.token_ms(1) == costs.decode[1]


def test_one_token_a_call_where_a_sequence_drafts_or_decoding_ahead_is_off() -> None:
    for requests, limits in (([request(20), request(20, steps=3)], AHEAD),
                             ([request(20)], Limits(max_queue=8))):
        outs, target = serve(requests, limits)
        assert all(len(t) == 20 for t in outs)
        assert {n for call in target.verifies for _, n in call} == {1}, requests


def test_no_decoding_ahead_while_a_waiting_request_could_take_a_free_slot() -> None:
    sched = Scheduler(InstantTarget(), InstantDraft(), max_sequences=2, limits=AHEAD)
    sched.chooser.costs.record_verify(1, 1, 0.1)  # a token's cost measured
    s = Sequence(1, request(100))
    sched.running.append(s)
    ops: list[TargetOp] = [Verify(1, capture=False)]
    assert decode_ahead(sched, ops, [s]) == 8
    sched.waiting.push(Sequence(2, request(100)), 1)
    assert decode_ahead(sched, ops, [s]) == 1  # it takes the free slot at the next cycle: no later
    sched.max_sequences = 1
    assert decode_ahead(sched, ops, [s]) == 8  # no slot for it: the running sequence decodes ahead


def test_a_request_waiting_for_a_slot_is_admitted_when_one_frees() -> None:
    outs, target = serve([request(12), request(12)], slots=1)
    assert [len(t) for t in outs] == [12, 12]
    first, second = target.verifies[0][0][0], target.verifies[-1][0][0]
    assert first != second and max(n for call in target.verifies for seq, n in call if seq == second) == 8


def test_the_services_give_the_same_tokens_a_token_a_call_or_decoding_ahead(tiny_target: Path, tiny_head: Path,
                                                                            tmp_path: Path) -> None:
    """Greedy streams through the three services, speculation off: the same tokens and the same
    count of cycles (a token each) with --decode-ahead-ms 0 and 1000, the tokens coming in bursts
    when ahead; a stop token inside a burst ends the stream there, as it would a token a call;
    a sampled stream gives the same tokens for its seed either way, in bursts too when ahead
    (its draws are counter-based: the same whichever call chooses them)."""
    got = []
    for ms in ("0", "1000"):
        cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=256, log_dir=tmp_path / ms,
                             extra_gateway_args=["--decode-ahead-ms", ms])
        with ServiceStack(cfg) as s:
            c = GatewayClient(s.addr("gateway"))
            try:
                runs = []
                for prompt in ([5, 6, 7], [9, 8, 7, 6, 5, 4]):
                    sizes: list[int] = []
                    gen = c.generate(make_request(token_ids=prompt, max_new_tokens=40, ignore_eos=True,
                                                  speculation=False),
                                     on_chunk=lambda m, sizes=sizes: sizes.append(len(m.token_ids)))
                    runs.append((gen.token_ids, gen.final.speculation.cycles, max(sizes)))
                stop = runs[0][0][13]  # a token some way into the first stream
                stopped = c.generate(make_request(token_ids=[5, 6, 7], max_new_tokens=40, ignore_eos=True,
                                                  speculation=False, stop_token_ids=[stop]))
                bursts: list[int] = []
                sampled = c.generate(make_request(token_ids=[5, 6, 7], max_new_tokens=24, ignore_eos=True,
                                                  speculation=False, temperature=0.8, seed=11),
                                     on_chunk=lambda m, bursts=bursts: bursts.append(len(m.token_ids)))
            finally:
                c.close()
        got.append((runs, (stopped.token_ids, stopped.final.finish_reason), sampled.token_ids, max(bursts)))
    (runs, stopped, sampled, one), (ahead_runs, ahead_stopped, ahead_sampled, ahead_one) = got
    for (tokens, cycles, _), (ahead_tokens, ahead_cycles, burst) in zip(runs, ahead_runs, strict=True):
        assert len(tokens) == 40 and tokens == ahead_tokens and cycles == ahead_cycles == 39
        assert burst >= 2
    assert max(size for _, _, size in runs) == 1
    first = runs[0][0]
    assert stopped == ahead_stopped and stopped[1] == "stop"
    assert stopped[0] == first[: first.index(first[13])]  # up to the stop token (not streamed)
    assert sampled == ahead_sampled and len(sampled) == 24 and one == 1 and ahead_one >= 2


@pytest.mark.gpu
@needs_gpus(1)
@pytest.mark.parametrize(("fused", "dtype"), [  # the quick subset: what serving runs, and the padded path in fp32
    pytest.param("off", "float32", marks=pytest.mark.quick), ("off", "bfloat16"), ("pdl", "float32"),
    pytest.param("pdl", "bfloat16", marks=pytest.mark.quick)])
def test_decoding_ahead_on_the_gpu_gives_the_tokens_of_one_token_calls(tiny_target: Path, fused: str,
                                                                        dtype: str) -> None:
    """On the fused and the padded path, three sequences side by side (one of them sampled)
    decode 24 tokens 8 a call from one graph, bit for bit the tokens of 24 one-token calls (the
    same kernels, the same counter-based draws), in bf16 too; on the fused path every graph the
    run replays, its prompts' (two of one length bucket, one of another) included, was captured
    before serving."""
    prompts = [[3, 1, 4, 1, 5], list(range(5, 40)), [7] * 9]
    samplings = [Sampling(), Sampling(temperature=0.8, top_p=0.95, seed=3), Sampling()]
    got = []
    for k in (1, 8):
        cfg = TargetConfig(model=str(tiny_target), device="cuda", dtype=dtype, fused_decode=fused, max_context=256,
                           max_sequences=4).validate()
        rt = TargetRuntime(cfg, TensorParallel())
        warmed = set(rt.engine.runner.graphs.graphs)
        try:
            rt.step([Prefill(i, prompts[i], samplings[i], capture=False) for i in range(len(prompts))], [])
            tokens: list[list[int]] = [[] for _ in prompts]
            for _ in range(24 // k):
                res, _ = rt.step([Verify(i, capture=False, decode=k) for i in range(len(prompts))], [])
                for t, r in zip(tokens, res, strict=True):
                    t += r.tokens
            got.append(tokens)
            graphs = set(rt.engine.runner.graphs.graphs)
            if k > 1:
                assert any(key[:3] == ("decode", 4, k) for key in graphs)
            if fused != "off":  # every graph, prompts' included, captured before serving
                assert graphs == warmed and rt.engine.runner.graphs.late_captures == 0
        finally:
            rt.close()
    assert got[0] == got[1] and all(len(t) == 24 for t in got[0])
