"""Shapes run before serving (draft_service.warmup, target_service.warmup): on the GPU a request of
any depth, extend length or tree size at batch one meets its kernels compiled and its graphs
captured, whatever its context length."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_service.config import DraftConfig
from draft_service.runtime import DraftRuntime, reads_ring
from draft_service.warmup import batch_shapes, extend_lengths, shapes, warm_up
from gateway.local import LocalEngines
from gateway.sequence import GenerationRequest
from specsplit.ops import Sampling, extend_bucket
from specsplit.runner.graphs import GraphCache
from specsplit.runner.prompts import prompt_buckets
from target_service.config import TargetConfig
from tests.test_gpu_services import needs_gpus


@pytest.mark.parametrize("max_steps", [1, 3, 8])
def test_every_extend_bucket_is_warmed_once(max_steps: int) -> None:
    lengths = extend_lengths(max_steps, 32)
    cycle, put_off = [n for n in lengths if n <= max_steps + 1], [n for n in lengths if n > max_steps + 1]
    # a cycle's extends (one graph with the proposal) and the longer ones put off (the padded step) are
    # different graphs even where their buckets meet
    assert sorted({extend_bucket(n) for n in range(1, max_steps + 2)}) == [extend_bucket(n) for n in cycle]
    assert sorted({extend_bucket(n) for n in range(max_steps + 2, 33)}) == [extend_bucket(n) for n in put_off]
    assert extend_lengths(8, 32) == [1, 2, 3, 5, 9, 10, 17]


def test_warm_topk_must_lie_within_max_topk() -> None:
    with pytest.raises(ValueError, match="warm_topk"):
        DraftConfig(warm_topk=[1, 9], max_topk=8).validate()
    assert DraftConfig(warm_topk=[2, 8]).validate().warm_topk == [2, 8]


def test_captures_hold_the_cyclic_collector_off_and_restore_it() -> None:
    import gc

    from specsplit.runner.graphs import collector_paused

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # another engine thread's capture
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # left as the process had it
    finally:
        gc.enable()


def test_a_new_ring_drops_the_graphs_that_read_the_old_one() -> None:
    cache = GraphCache(torch.device("cpu"))
    keys = [("extend+grow", 1, 4, 1728, 4, 3, 2153, ("ring", 1234)), ("extend+grow", 1, 4, 1728, 4, 3, 2153, None),
            ("padded", 1, 16, 2153, False, False, 1728, False, None)]
    cache.graphs.update(dict.fromkeys(keys))  # type: ignore[arg-type]
    assert cache.forget(reads_ring) == 1
    assert list(cache.graphs) == keys[1:]


def test_the_warm_up_runs_every_shape_on_a_scratch_slot(tiny_target: Path, tiny_head: Path) -> None:
    """On the CPU the draft runs no graphs and warms nothing; made to run its padded path as on a
    GPU, the warm-up runs each shape once, and eagerly a cycle of every batch bucket, and leaves
    its slots and sequences as it found them."""
    rt = DraftRuntime(DraftConfig(head=str(tiny_head), target=str(tiny_target), max_context=128, max_steps=4))
    engine, r = rt.engine, rt.engine.runner
    assert warm_up(engine, [1, 4], capture=False) == 0
    free = r.free_slots
    r.padded, r.graphs.enabled = True, True  # (eager all the same: capture=False turns the graphs off)
    try:
        batches = list(batch_shapes(engine, [1, 4]))  # buckets 2, 4, 8, 16 of the 16 slots, extends of 1 and 5
        assert batches[:2] == [(2, 1, 1), (2, 5, 1)] and len(batches) == 4 * 2 * 2
        assert warm_up(engine, [1, 4, 99], capture=False) == len(list(shapes(engine, [1, 4]))) + len(batches)
        assert len(list(shapes(engine, [1, 4]))) == 4 + 2 * 4 * 7  # the extends alone: buckets of 1, 2, 4 and 8 tokens
    finally:
        r.padded, r.graphs.enabled = False, False
    assert r.free_slots == free and not engine.seqs and not r.graphs.graphs


def test_the_target_warms_every_batch_and_verify_length_that_fits_its_fused_step(tiny_target: Path) -> None:
    """The target's warm-up (its fused step stood in for on the CPU) runs, for every batch bucket B
    and verify length T up to max_draft_tokens + 1 with B·T within the fused step, a row with and
    without features (T = 1), chains and trees (T > 1), on a scratch slot freed after."""
    from specsplit.runner.graphs import batch_buckets
    from target_service.engine import TargetEngine
    from target_service.warmup import verify_steps
    from target_service.warmup import warm_up as warm_target
    from tests.test_fused_decode import PaddedAsFused
    from tests.test_static_batches import tiny_model

    model = tiny_model(tiny_target)
    engine = TargetEngine(TargetConfig(model=str(tiny_target), max_context=128, max_draft_tokens=4,
                                       max_sequences=20), model)
    r = engine.runner
    assert r.fused is None and warm_target(engine) == 0  # the CPU: no fused step, nothing warmed
    fused = PaddedAsFused(model)
    fused.max_rows = 16
    r.fused, r.batch_buckets = fused, batch_buckets(20, fused.few_rows)  # type: ignore[assignment]
    want = {(b, t) for b in (1, 2, 3, 4, 8, 16) for t in range(1, 6) if b * t <= 16}
    steps = list(verify_steps(engine, 0))
    assert {(len(s.rows), len(s.rows[0].tokens)) for s in steps} == want
    assert sum(len(s.rows[0].tokens) > 1 for s in steps) == 2 * len([1 for b, t in want if t > 1])  # chains, trees
    free = r.free_slots
    n = warm_target(engine)
    assert n >= len(steps) and r.free_slots == free and not engine.seqs
    assert want <= set(fused.rows)


PROMPTS = [[1, 2, 3], [7] * 20, [100, 42, 17, 250, 3, 3, 9], list(range(10, 60))]


@pytest.mark.quick
@pytest.mark.gpu
@needs_gpus(1)
def test_warmed_engines_capture_nothing_while_serving(tiny_target: Path, tiny_head: Path) -> None:
    """fp32, CUDA IPC, the fused target step and head: chains of every depth, trees and adaptive
    requests, one at a time, capture no graph after start, their prompts' and the draft's
    extends of them included (and stay lossless); in batches of 3 and 4 the target captures none
    either, and each request gives its tokens alone."""
    engines = LocalEngines(TargetConfig(model=str(tiny_target), device="cuda", dtype="float32", max_context=256,
                                        hidden_backend="cuda_ipc", fused_decode="pdl"),
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), device="cuda", dtype="float32",
                                       max_context=256))
    try:
        assert engines.draft is not None
        target, draft = engines.target.engine.runner.graphs.graphs, engines.draft.engine.runner.graphs.graphs

        def cycles() -> tuple[set[tuple[object, ...]], set[tuple[object, ...]]]:
            return set(target), set(draft)

        warmed = cycles()
        assert len(warmed[0]) >= 30 and len(warmed[1]) >= 90, warmed
        assert sum(k[0] == "prompts" and k[-1] for k in warmed[0]) == 2 * len(prompt_buckets(256 + 17))  # prefills
        assert sum(k[0] == "prompts" for k in warmed[1]) >= len(prompt_buckets(256))
        requests = [GenerationRequest(p, 40, Sampling(), {511}, 0) for p in PROMPTS]
        requests += [GenerationRequest(p, 40, Sampling(), {511}, steps) for steps in (1, 3, 8) for p in PROMPTS]
        requests += [GenerationRequest(p, 40, Sampling(), {511}, 5, 4, 16) for p in PROMPTS]
        requests += [GenerationRequest(p, 40, Sampling(), {511}, 3, 4, 8, adaptive=True) for p in PROMPTS]
        out = [engines.generate([r])[0].tokens for r in requests]  # one at a time: batches of one
        assert cycles() == warmed, (cycles()[0] - warmed[0], cycles()[1] - warmed[1])
        for i, tokens in enumerate(out):
            assert tokens == out[i % len(PROMPTS)], i
        # batches: the target's verifies of 3 or 4 sequences (chains, trees of 17 rows, adaptive) are warmed too
        for group in (requests[4:7], requests[16:19], requests[-4:]):
            got = [res.tokens for res in engines.generate(group)]
            assert got == [out[requests.index(r) % len(PROMPTS)] for r in group]
        assert cycles()[0] == warmed[0], cycles()[0] - warmed[0]
        assert engines.target.engine.runner.graphs.over_budget == engines.draft.engine.runner.graphs.over_budget == 0
    finally:
        engines.close()


def test_the_draft_service_captures_its_warm_up_after_the_attach_reply(tiny_target: Path, tiny_head: Path) -> None:
    """Attach maps the ring and answers; the warm-up's graphs are captured next on the engine's
    thread, under the engine's lock (steps that come meanwhile wait), and a failure there is
    logged, not raised."""
    from opentelemetry import metrics, trace

    from draft_service.server import DraftServicer
    from specsplit.observability.telemetry import Telemetry
    from specsplit.transport.handoff import open_writer

    rt = DraftRuntime(DraftConfig(head=str(tiny_head), target=str(tiny_target), max_context=128))
    servicer = DraftServicer(rt, Telemetry(trace.get_tracer("test"), metrics.get_meter("test")))
    writer = open_writer("shm", 64, 3 * rt.head.cfg.target_hidden_size, torch.float32)
    seen: list[tuple[bool, bool]] = []

    def warm() -> int:
        seen.append((rt.descriptor is not None, servicer.engine_lock.locked()))
        raise RuntimeError("a warm-up that fails")

    rt.warm_graphs = warm  # type: ignore[method-assign]
    try:
        servicer.executor.submit(servicer._attach, writer.descriptor).result()
        servicer.executor.submit(lambda: None).result()  # after the warm-up queued behind the attach
        assert seen == [(True, True)]
        assert rt.engine.reader is not None  # attached all the same
    finally:
        servicer.executor.shutdown()
        if rt.engine.reader is not None:
            rt.engine.reader.close()
        writer.close()
