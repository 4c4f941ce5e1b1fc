"""Drafting ahead in the draft engine: the next cycle's proposal from assumed drafts, nothing
past the extend committed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from bench.replay import ReplayDraft, Replayer
from draft_service.config import DraftConfig
from draft_service.runtime import DraftRuntime
from gateway.clients import LocalDraft
from gateway.local import LocalEngines
from gateway.sequence import GenerationRequest
from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.ops import Code, ExtendPropose, HiddenRef, Sampling
from specsplit.placement import device_identity, draft_ahead_on
from specsplit.transport.handoff import open_writer
from target_service.config import TargetConfig
from tests.test_draft import make_runtime, put
from tests.test_gpu_services import needs_gpus
from tests.test_lossless import TINY_PROMPTS, request
from tests.test_services import wait_idle


def _setup(tiny_target: Path, tiny_head: Path, seed: int = 0):  # noqa: ANN202
    rt, writer = make_runtime(tiny_target, tiny_head)
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(24, writer.descriptor.width, generator=g)
    tokens = torch.randint(0, 512, (24,), generator=g).tolist()
    return rt, writer, feats, tokens


@pytest.mark.parametrize("padded", [False, True])
def test_ahead_of_a_chain_continues_the_greedy_chain(tiny_target: Path, tiny_head: Path, padded: bool) -> None:
    """Assuming a greedy chain's drafts accepted, the guessed token and the next drafts are the
    chain's own continuation: a chain of 3 drafted ahead by 3 equals the first 7 of a chain of 7
    (the CPU's path, and the GPU's padded one whose extend and proposal are one function)."""
    rt, writer, feats, tokens = _setup(tiny_target, tiny_head)
    rt.engine.runner.padded = padded
    try:
        (long,) = rt.engine.execute([ExtendPropose(1, tokens[:16], put(writer, feats[:16]), 7)])
        (short,) = rt.engine.execute([ExtendPropose(2, tokens[:16], put(writer, feats[:16]), 3)])
        assert long.code == short.code == Code.OK and short.ahead == []
        assert short.draft_ids == long.draft_ids[:3]
        (ahead,) = rt.engine.execute([ExtendPropose(2, [], HiddenRef(0, 0, 0), 3, position=16,
                                                    ahead=short.draft_ids)])
        assert ahead.code == Code.OK and ahead.draft_ids == []
        assert sorted(o.accepted for o in ahead.ahead) == [0, 0, 1, 1, 2, 2, 3, 3]  # two guesses after each node
        assert all(o.node == o.accepted - 1 for o in ahead.ahead)
        whole = next(o for o in ahead.ahead if o.accepted == 3 and o.bonus == long.draft_ids[3])
        assert whole.draft_ids == long.draft_ids[4:7]
        for o in ahead.ahead:  # each departs from the chain where it says, with 3 drafts of its own
            assert o.accepted == 3 or o.bonus != short.draft_ids[o.accepted]
            assert len(o.draft_ids) == 3 and o.draft_parents == []
        assert rt.engine.seqs[2].length == 16  # nothing past the extend committed
        assert rt.engine.runner.free_slots == 12 - 2  # the scratch slots back
    finally:
        writer.close()


def test_ahead_commits_its_extend_only(tiny_target: Path, tiny_head: Path) -> None:
    """An extend that drafts ahead commits its tokens and nothing more: the next extend from
    there proposes what it would have without the ahead (the assumed entries overwritten)."""
    rt, writer, feats, tokens = _setup(tiny_target, tiny_head, seed=1)
    try:
        rt.engine.execute([ExtendPropose(1, tokens[:12], put(writer, feats[:12]), 3),
                           ExtendPropose(2, tokens[:12], put(writer, feats[:12]), 3)])
        (a,) = rt.engine.execute([ExtendPropose(1, tokens[12:16], put(writer, feats[12:16]), 4, position=12,
                                                ahead=[5, 6, 7], topk=2, num_draft_tokens=6)])
        (b,) = rt.engine.execute([ExtendPropose(2, tokens[12:16], put(writer, feats[12:16]), 4, position=12)])
        assert a.code == b.code == Code.OK and a.draft_ids == []
        assert any(o.accepted == 3 for o in a.ahead)
        assert all(len(o.draft_ids) == 5 and len(o.draft_parents) == 5 for o in a.ahead)
        assert rt.engine.seqs[1].length == rt.engine.seqs[2].length == 16
        (a2,) = rt.engine.execute([ExtendPropose(1, tokens[16:20], put(writer, feats[16:20]), 4, position=16)])
        (b2,) = rt.engine.execute([ExtendPropose(2, tokens[16:20], put(writer, feats[16:20]), 4, position=16)])
        assert a2.draft_ids == b2.draft_ids
    finally:
        writer.close()


def test_an_outcome_depends_on_the_path_up_to_where_it_departs(tiny_target: Path, tiny_head: Path) -> None:
    """An outcome that departs from the path after d drafts is the same whatever the path holds
    past d + 1, whichever scratch slot it had and whatever shares the step; without free slots only
    the whole path's outcome is proposed."""
    rt, writer, feats, tokens = _setup(tiny_target, tiny_head, seed=2)
    try:
        rt.engine.execute([ExtendPropose(i, tokens[:12], put(writer, feats[:12]), 3, topk=2, num_draft_tokens=6)
                           for i in (1, 2, 3)])
        opts = {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}
        (a,) = rt.engine.execute([ExtendPropose(1, [], HiddenRef(0, 0, 0), position=12, ahead=[5, 6, 7], **opts)])
        b, c = rt.engine.execute([ExtendPropose(3, [], HiddenRef(0, 0, 0), position=12, ahead=[9, 9], **opts),
                                  ExtendPropose(2, [], HiddenRef(0, 0, 0), position=12, ahead=[5, 6], **opts)])
        by = {(o.accepted, o.bonus): o for o in a.ahead}
        shared = [o for o in c.ahead if o.accepted <= 1]  # departures before the paths part
        assert shared and all(by[(o.accepted, o.bonus)] == o for o in shared)
        assert len(b.ahead) + len(c.ahead) == 2 + 8  # the whole paths' and as many others as scratch slots
        rt.engine.runner._free.clear()  # noqa: SLF001 - no slot free
        (d,) = rt.engine.execute([ExtendPropose(1, [], HiddenRef(0, 0, 0), position=12, ahead=[5, 6, 7], **opts)])
        assert d.ahead == [a.ahead[0]]
    finally:
        writer.close()


def test_a_tree_drafted_ahead_has_outcomes_on_every_branch(tiny_target: Path, tiny_head: Path) -> None:
    """Drafting ahead over a tree: outcomes after every node, a side branch's the same as for a
    chain of that branch's drafts; a guess is never a token the verify tries there."""
    rt, writer, feats, tokens = _setup(tiny_target, tiny_head, seed=3)
    try:
        rt.engine.ahead_slots = 9  # room for every outcome: 1 + 9 scratch
        rt.engine.execute([ExtendPropose(i, tokens[:12], put(writer, feats[:12]), 3) for i in (1, 2)])
        tree, parents = [11, 22, 33, 44], [-1, -1, 0, 1]  # 11 -> 33 and 22 -> 44
        (t,) = rt.engine.execute([ExtendPropose(1, [], HiddenRef(0, 0, 0), 3, position=12, ahead=tree,
                                                ahead_parents=parents)])
        (c,) = rt.engine.execute([ExtendPropose(2, [], HiddenRef(0, 0, 0), 3, position=12, ahead=[22, 44])])
        assert t.code == c.code == Code.OK
        assert sorted(o.node for o in t.ahead) == [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3]  # two guesses after each
        assert t.ahead[0].node == 2 and t.ahead[0].accepted == 2  # the best path (11 -> 33), in its own slot
        branch = {(o.accepted, o.bonus): o for o in t.ahead if o.node in (1, 3)}
        chain = {(o.accepted, o.bonus): o for o in c.ahead if o.node in (0, 1)}
        shared = set(branch) & set(chain)
        assert shared and all(branch[k].draft_ids == chain[k].draft_ids for k in shared)
        tried = {-1: {11, 22}, 0: {33}, 1: {44}, 2: set(), 3: set()}
        assert all(o.bonus not in tried[o.node] for o in t.ahead)
    finally:
        writer.close()


def test_a_call_drafts_ahead_for_each_entry_as_for_it_alone(tiny_target: Path, tiny_head: Path) -> None:
    """Entries of one call (a chain and a tree, so two functions; one extending, one not; drafts
    of different counts and depths) each get the best path's outcome they get alone, and every
    other outcome they share with it is the same."""
    rt, writer, feats, tokens = _setup(tiny_target, tiny_head, seed=5)

    def ops() -> list[ExtendPropose]:
        return [ExtendPropose(1, tokens[12:15], put(writer, feats[12:15]), 3, position=12, ahead=[5, 6, 7]),
                ExtendPropose(2, [], HiddenRef(0, 0, 0), 2, position=12, ahead=[8]),
                ExtendPropose(3, tokens[12:14], put(writer, feats[12:14]), 2, position=12, topk=2,
                              num_draft_tokens=4, ahead=[9, 10, 11], ahead_parents=[-1, -1, 0])]

    def fresh() -> None:  # each sequence at entry 12 again
        rt.engine.execute([ExtendPropose(i, tokens[:12], put(writer, feats[:12]), 1) for i in (1, 2, 3)])

    try:
        fresh()
        together = rt.engine.execute(ops())
        alone = []
        for op in ops():
            fresh()
            alone += rt.engine.execute([op])
        for t, a in zip(together, alone, strict=True):
            assert t.code == a.code == Code.OK and t.ahead and t.ahead[0] == a.ahead[0]
            by = {(o.node, o.bonus): o for o in a.ahead}
            assert all(by[(o.node, o.bonus)] == o for o in t.ahead if (o.node, o.bonus) in by), (t.ahead, a.ahead)
        assert [len(r.ahead[0].draft_ids) for r in together] == [3, 2, 3]  # each its own shape
    finally:
        writer.close()


@pytest.mark.parametrize(("op", "why"), [
    (ExtendPropose(1, [], HiddenRef(0, 0, 0), 3, position=8, ahead=[1, 2]), "nothing extended"),
    (ExtendPropose(1, [], HiddenRef(0, 0, 0), 3, position=12, ahead=[1, 2]), "nothing extended"),
    (ExtendPropose(1, [], HiddenRef(0, 0, 0), 0, position=12, ahead=[1, 2]), "within 1.."),
    (ExtendPropose(1, [], HiddenRef(0, 0, 0), 3, position=12, ahead=[1] * 9), "within 1.."),
    (ExtendPropose(1, [], HiddenRef(0, 0, 0), 3, position=12, ahead=[512]), "outside the vocabulary"),
    (ExtendPropose(1, [], HiddenRef(0, 0, 0), 3, position=12, ahead=[1, 2], ahead_parents=[-1, 1]), "earlier parent"),
    (ExtendPropose(1, [], HiddenRef(0, 0, 0), 3, position=12, ahead=[1, 2], ahead_parents=[-1]), "earlier parent"),
    (ExtendPropose(1, [], HiddenRef(0, 0, 0), 3, position=12, ahead=[1, 2, 3], ahead_parents=[-1, 0, -1]),
     "level by level"),
    (ExtendPropose(3, [1], HiddenRef(0, 1, 0), 3, Sampling(temperature=0.7), ahead=[1]), "greedy sequences only"),
])
def test_bad_ahead_is_refused(tiny_target: Path, tiny_head: Path, op: ExtendPropose, why: str) -> None:
    rt, writer, feats, tokens = _setup(tiny_target, tiny_head)
    try:
        rt.engine.execute([ExtendPropose(2, tokens[:12], put(writer, feats[:12]), 3)])  # sequence 1: none yet
        if op.seq_id != 1 or any(w in why for w in ("within", "vocabulary", "parent", "level")):
            rt.engine.execute([ExtendPropose(1, tokens[:12], put(writer, feats[:12]), 3)])
        (r,) = rt.engine.execute([op])
        assert r.code == Code.INVALID_ARGUMENT and why in r.message, r.message
    finally:
        writer.close()


def test_ahead_near_the_context_end_makes_no_proposal(tiny_target: Path, tiny_head: Path) -> None:
    """Without room for the assumed drafts before the context's end, the extend is made and no
    proposal: the gateway counts it as a miss."""
    rt, writer = make_runtime(tiny_target, tiny_head)
    try:
        n = rt.engine.max_context - 2
        feats = torch.randn(n, writer.descriptor.width)
        (r,) = rt.engine.execute([ExtendPropose(1, [3] * n, put(writer, feats), 2, ahead=[4, 5])])
        assert r.code == Code.OK and r.ahead == [] and r.draft_ids == []
        assert rt.engine.seqs[1].length == n
    finally:
        writer.close()


@pytest.mark.parametrize(("topk", "rate"), [(1, 1.0), (1, 0.8), (4, 0.8), (1, None), (4, None)])
def test_drafting_ahead_is_lossless(tiny_engines: LocalEngines, topk: int, rate: float | None) -> None:
    """Greedy output with drafting ahead equals target-only output, chains and trees, with hits
    (replayed acceptance: every draft and guess right at rate 1.0) and misses (the random head)."""
    base = tiny_engines.generate([request(p, 0, 40, {511}) for p in TINY_PROMPTS])
    draft = None
    if rate is not None:
        refs = [p + b.tokens for p, b in zip(TINY_PROMPTS, base, strict=True)]
        draft = ReplayDraft(LocalDraft(tiny_engines.draft), Replayer(refs, rate, 512))
    tiny_engines.draft_ahead = True
    try:
        reqs = [GenerationRequest(p, 40, Sampling(), {511}, 4, topk, 8 if topk > 1 else 0) for p in TINY_PROMPTS]
        spec = tiny_engines.generate(reqs, draft)
    finally:
        tiny_engines.draft_ahead = False
    assert [s.tokens for s in spec] == [b.tokens for b in base]
    hits = sum(s.stats.ahead_hits for s in spec)
    misses = sum(s.stats.ahead_misses for s in spec)
    if rate == 1.0:
        assert misses <= len(TINY_PROMPTS) and hits > 5 * len(TINY_PROMPTS)  # a miss at most where a stream ends
    elif rate is not None:
        assert hits > 0 and misses > 0
    else:
        assert misses > 0
    assert tiny_engines.target.stats()["ring_rows_in_use"] == 0
    assert tiny_engines.draft.stats()["active_sequences"] == 0


CODE_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


@pytest.fixture(scope="module")
def ahead_stack(tmp_path_factory: pytest.TempPathFactory) -> ServiceStack:
    """SmolLM2 and its shipped head as three processes, drafting ahead."""
    cfg = StackConfig.of(model="smollm2", max_context=512, max_sequences=4, dtype="float32",
                         log_dir=tmp_path_factory.mktemp("logs"), extra_gateway_args=["--draft-ahead", "on"])
    with ServiceStack(cfg) as s:
        yield s


@pytest.mark.parametrize("shape", [{"num_steps": 3}, {"num_steps": 4, "topk": 4, "num_draft_tokens": 8}])
def test_services_drafting_ahead_equal_target_only(ahead_stack: ServiceStack, shape: dict[str, int]) -> None:
    """Through the services: the tokens of speculation off, two streams at once, with hits."""
    client = GatewayClient(ahead_stack.addr("gateway"))
    try:
        prompts = [CODE_PROMPT, "List the first ten prime numbers, separated by commas."]
        base = [client.generate(make_request(p, max_new_tokens=48, speculation=False)) for p in prompts]
        with ThreadPoolExecutor(2) as pool:
            spec = list(pool.map(lambda p: client.generate(make_request(p, max_new_tokens=48, **shape)), prompts))
        assert [list(s.token_ids) for s in spec] == [list(b.token_ids) for b in base]
        stats = [s.final.speculation for s in spec]
        assert sum(s.draft_ahead_hits for s in stats) > 0 and sum(s.draft_ahead_misses for s in stats) > 0
        assert all(s.draft_ahead_hits + s.draft_ahead_misses <= s.cycles for s in stats)
    finally:
        client.close()
    t, d = wait_idle(ahead_stack)
    assert t.active_sequences == t.ring_rows_in_use == d.active_sequences == 0


def test_a_stream_cancelled_while_drafting_ahead_is_released(ahead_stack: ServiceStack) -> None:
    client = GatewayClient(ahead_stack.addr("gateway"))
    try:
        call = client.stub.Generate(make_request(CODE_PROMPT, max_new_tokens=400, ignore_eos=True, num_steps=3))
        next(call)
        next(call)
        call.cancel()
    finally:
        client.close()
    t, d = wait_idle(ahead_stack)
    assert t.active_sequences == t.ring_rows_in_use == d.active_sequences == 0


def test_the_hit_rate_bench_reads_a_verify_outcome_as_the_target_decides_it() -> None:
    """bench.ahead_acceptance's outcome of a verify: the drafts accepted and the last one's index."""
    from bench.ahead_acceptance import path_end

    assert path_end([5, 6, 7], [], [5, 6, 9, 1]) == (2, 1)
    assert path_end([5, 6, 7], [], [4, 5]) == (0, -1)
    assert path_end([5, 6, 7], [], [5, 6, 7, 8]) == (3, 2)
    tree, parents = [11, 22, 33, 44], [-1, -1, 0, 1]
    assert path_end(tree, parents, [22, 44, 1]) == (2, 3)
    assert path_end(tree, parents, [11, 9]) == (1, 0)


def test_auto_drafts_ahead_only_with_the_draft_on_a_gpu_of_its_own() -> None:
    assert draft_ahead_on("auto", "cuda GPU-1f2e", "cuda GPU-9a8b")
    assert not draft_ahead_on("auto", "cuda GPU-1f2e", "cuda GPU-1f2e")  # one GPU, whatever each container calls it
    assert not draft_ahead_on("auto", "cpu", "cpu") and not draft_ahead_on("auto", "", "cuda GPU-9a8b")
    assert draft_ahead_on("on", "cpu", "cpu") and not draft_ahead_on("off", "cuda GPU-1", "cuda GPU-2")
    assert device_identity("cpu") == "cpu"


@pytest.mark.gpu
@needs_gpus(1)
@pytest.mark.parametrize("topk", [1, pytest.param(4, marks=pytest.mark.quick)])
def test_drafting_ahead_on_the_gpu_is_lossless(tiny_target: Path, tiny_head: Path, topk: int) -> None:
    """On the GPU (fp32, the padded path and its graphs, the CUDA IPC ring): drafting ahead with
    replayed acceptance gives the target-only tokens, with hits, and leaves nothing held."""
    engines = LocalEngines(TargetConfig(model=str(tiny_target), device="cuda", max_context=256,
                                        hidden_backend="cuda_ipc"),
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), device="cuda", max_context=256))
    try:
        base = engines.generate([request(p, 0, 40, {511}) for p in TINY_PROMPTS])
        refs = [p + b.tokens for p, b in zip(TINY_PROMPTS, base, strict=True)]
        engines.draft_ahead = True
        reqs = [GenerationRequest(p, 40, Sampling(), {511}, 4, topk, 8 if topk > 1 else 0) for p in TINY_PROMPTS]
        spec = engines.generate(reqs, ReplayDraft(LocalDraft(engines.draft), Replayer(refs, 0.8, 512)))
        assert [s.tokens for s in spec] == [b.tokens for b in base]
        assert sum(s.stats.ahead_hits for s in spec) > 0
        assert engines.target.stats()["ring_rows_in_use"] == 0
        assert engines.draft is not None and engines.draft.stats()["active_sequences"] == 0
    finally:
        engines.close()


class FailsAheadOnce(LocalDraft):
    """The draft's first draft-ahead result for each sequence comes back failed."""

    def __init__(self, runtime: object) -> None:
        super().__init__(runtime)
        self.failed: set[int] = set()

    async def receive(self, sent: list, timeout: float = 0.0):  # noqa: ANN001, ANN201
        results, timing = await super().receive(sent, timeout)
        for r in results:
            if r.seq_id not in self.failed:
                self.failed.add(r.seq_id)
                r.code, r.message, r.ahead = Code.INTERNAL, "injected", []
        return results, timing


def test_a_sequence_the_draft_fails_ahead_is_resynced(tiny_engines: LocalEngines) -> None:
    """A draft-ahead result that failed (the draft's state for the sequence unknown) resyncs
    the sequence from the target's recomputed features; the tokens stay the target-only ones."""
    base = tiny_engines.generate([request(p, 0, 30, {511}) for p in TINY_PROMPTS])
    draft = FailsAheadOnce(tiny_engines.draft)
    tiny_engines.draft_ahead = True
    try:
        spec = tiny_engines.generate([request(p, 3, 30, {511}) for p in TINY_PROMPTS], draft)
    finally:
        tiny_engines.draft_ahead = False
    assert [s.tokens for s in spec] == [b.tokens for b in base]
    assert len(draft.failed) == len(TINY_PROMPTS)
    assert all(s.stats.ahead_misses > 0 for s in spec)  # drafting ahead went on after the resync
    assert tiny_engines.target.stats()["ring_rows_in_use"] == 0
    assert tiny_engines.draft.stats()["active_sequences"] == 0


def test_drafting_ahead_with_steps_chosen_per_cycle_is_lossless(tiny_engines: LocalEngines) -> None:
    """Requests whose shape the gateway chooses each cycle (the default): a pre-draft keeps the
    shape it was drafted with, and the tokens are the target-only ones."""
    base = tiny_engines.generate([request(p, 0, 40, {511}) for p in TINY_PROMPTS])
    refs = [p + b.tokens for p, b in zip(TINY_PROMPTS, base, strict=True)]
    draft = ReplayDraft(LocalDraft(tiny_engines.draft), Replayer(refs, 0.9, 512))
    tiny_engines.draft_ahead = True
    try:
        reqs = [GenerationRequest(p, 40, Sampling(), {511}, 4, adaptive=True, min_steps=1) for p in TINY_PROMPTS]
        spec = tiny_engines.generate(reqs, draft)
    finally:
        tiny_engines.draft_ahead = False
    assert [s.tokens for s in spec] == [b.tokens for b in base]
    assert sum(s.stats.ahead_hits for s in spec) > 0


@pytest.mark.quick
@pytest.mark.gpu
@needs_gpus(1)
def test_drafting_ahead_on_the_gpu_is_one_graph_replay_a_call(tiny_target: Path, tiny_head: Path) -> None:
    """On the GPU a call that extends and drafts ahead (the tree's forwards, the candidates, their
    slots' entries, the guesses and their growth) replays one CUDA graph, and its outcomes are
    those of the same function run eagerly."""
    got = []
    for graphs in (False, True):
        rt = DraftRuntime(DraftConfig(head=str(tiny_head), target=str(tiny_target), device="cuda", max_context=256,
                                      max_sequences=4, cuda_graphs=graphs))
        writer = open_writer("shm", 512, 3 * rt.head.cfg.target_hidden_size, torch.float32)
        rt.attach(writer.descriptor)
        g = torch.Generator().manual_seed(4)
        feats = torch.randn(40, writer.descriptor.width, generator=g)
        tokens = torch.randint(0, 512, (40,), generator=g).tolist()
        try:
            rt.engine.execute([ExtendPropose(1, tokens[:12], put(writer, feats[:12]), 3, topk=2, num_draft_tokens=6)])
            outcomes = []
            for start in (12, 16, 20, 24):
                replays = rt.engine.runner.graphs.replays
                ref = put(writer, feats[start : start + 4])
                (r,) = rt.engine.execute([ExtendPropose(1, tokens[start : start + 4], ref, 3, position=start, topk=2,
                                                        num_draft_tokens=6, ahead=[5, 6, 7, 8],
                                                        ahead_parents=[-1, -1, 0, 1])])
                assert r.code == Code.OK and len(r.ahead) > 1
                assert rt.engine.runner.graphs.replays - replays == (1 if graphs else 0)
                outcomes.append(r.ahead)
            got.append(outcomes)
        finally:
            writer.close()
    assert got[0] == got[1]
