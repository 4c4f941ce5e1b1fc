"""Tree speculation (greedy): the tree mask and positions, the verifier's walk, the target's KV
compaction, the draft's tree, request validation, and losslessness in process and over gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from draft_service.config import DraftConfig
from draft_service.runtime import DraftRuntime
from draft_service.tree import fused_top_k, grow_trees, top_log_probs, tree_result
from gateway.clients import Meanwhile
from gateway.config import GatewayConfig
from gateway.local import LocalEngines
from gateway.requests import InvalidRequest, ModelLimits, tree_shape
from gateway.scheduler import GenerationRequest
from specsplit.models.batch import Segment, tree_segment
from specsplit.ops import Code, ExtendPropose, HiddenRef, Prefill, Release, Sampling, Verify
from specsplit.runner.acceptance import accept, row_fields
from specsplit.tokenizer import TextCodec
from specsplit.transport.handoff.factory import open_reader
from target_service.config import TargetConfig
from tests.test_gpu_services import needs_gpus
from tests.test_lossless import CHAT_PROMPTS, TINY_PROMPTS
from tests.test_target_engine import runtime


def test_tree_segment_positions_and_mask() -> None:
    seg = tree_segment(slot=2, start=3, parents=[-1, 0, 0, 1])  # root, two children, a grandchild under the first
    assert seg.positions.tolist() == [3, 4, 4, 5]
    assert seg.visible.tolist() == [[True] * 3 + [True, False, False, False],
                                    [True] * 3 + [True, True, False, False],
                                    [True] * 3 + [True, False, True, False],
                                    [True] * 3 + [True, True, False, True]]


def walk_tree(best: list[int], draft_ids: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """The reference walk: from `last` down, while one of the children is the target's argmax
    (the first such child) -> (path: indices into [last, d1..dn]; the accepted drafts + the
    target's next token). parents[i]: d(i+1)'s parent in draft_ids, -1 for `last`."""
    children: dict[tuple[int, int], int] = {}
    for i, (token, parent) in enumerate(zip(draft_ids, parents, strict=True)):
        children.setdefault((parent + 1, token), i + 1)
    path, node = [0], 0
    while (child := children.get((node, best[node]))) is not None:
        path.append(child)
        node = child
    return path, [draft_ids[i - 1] for i in path[1:]] + [best[node]]


def device_accept(best: list[int], draft_ids: list[int], parents: list[int] | None, t: int
                  ) -> tuple[list[int], list[int]]:
    """specsplit.runner.acceptance on one row padded to t nodes, as (path, emitted) like walk_tree."""
    tokens = [0, *draft_ids]
    nodes = [-1, *(p + 1 for p in parents)] if parents is not None else None
    parent, expect = row_fields(tokens, nodes, True, t)
    ancestors = None
    if parents is not None:
        ancestors = torch.zeros(1, t, t, dtype=torch.bool)
        for j in range(t):
            k = j
            while k >= 0:
                ancestors[0, j, k] = True
                k = parent[k]
    padded = torch.tensor([[*best, *[0] * (t - len(best))]])
    path, count = accept(padded, torch.tensor([expect]), torch.tensor([parent]), ancestors)
    got = path[0, : int(count[0])].tolist()
    return got, [draft_ids[i - 1] for i in got[1:]] + [best[got[-1]]]


def test_verify_tree_walks_the_matching_path() -> None:
    # drafts: 5 and 6 under the root, 7 under 6, 8 under 5; the target wants 6, then 7, then 1
    for walk in (walk_tree, lambda b, d, p: device_accept(b, d, p, 8)):
        path, emitted = walk([6, 0, 7, 1, 0], [5, 6, 7, 8], [-1, -1, 1, 0])
        assert path == [0, 2, 3] and emitted == [6, 7, 1]
        path, emitted = walk([9, 0, 0, 0, 0], [5, 6, 7, 8], [-1, -1, 1, 0])
        assert path == [0] and emitted == [9]  # nothing matches: the target's own token
        path, emitted = walk([6, 7, 7, 1, 0], [6, 6, 7, 7], [-1, -1, 1, 0])
        assert path == [0, 1, 4] and emitted == [6, 7, 0]  # twin children: the first is walked


def test_device_acceptance_equals_the_walk_on_random_trees_and_chains() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        n = int(torch.randint(0, 12, (1,), generator=g))
        draft_ids = torch.randint(0, 3, (n,), generator=g).tolist()  # few ids: twins and matches are common
        best = torch.randint(0, 3, (n + 1,), generator=g).tolist()
        t = n + 1 + trial % 3  # padded
        if trial % 4 == 0:  # a chain
            ref = walk_tree(best, draft_ids, list(range(-1, n - 1)))
            assert device_accept(best, draft_ids, None, t) == ref
        parents = [int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)]
        assert device_accept(best, draft_ids, parents, t) == walk_tree(best, draft_ids, parents)


def greedy_continuation(tiny_target: Path, prompt: list[int], n: int) -> list[int]:
    rt = runtime(tiny_target)
    try:
        (res,), _ = rt.step([Prefill(1, prompt, capture=False)], [])
        out = list(res.tokens)
        while len(out) < n:
            (res,), _ = rt.step([Verify(1, [], capture=False)], [])
            out += res.tokens
        return out[:n]
    finally:
        rt.close()


def test_tree_verify_accepts_a_scattered_path_and_moves_its_kv(tiny_target: Path) -> None:
    """The accepted nodes sit at tree indices 2, 4, 5; after the verify the sequence must go on
    exactly as target-only decoding does, and the rows handed to the draft are those of the path."""
    prompt = [3, 14, 15, 92, 65]
    g = greedy_continuation(tiny_target, prompt, 10)  # g[0] comes from the prefill
    wrong = (g[1] + 1) % 512
    rt = runtime(tiny_target, max_context=64, max_draft_tokens=8, max_sequences=2)
    try:
        (p1, p2), _ = rt.step([Prefill(1, prompt), Prefill(2, prompt)], [])
        assert p1.tokens == p2.tokens == g[:1]
        # drafts: wrong, g1 under the root; g3 under `wrong`; g2 under g1; g3 under g2
        tree = Verify(1, [wrong, g[1], g[3], g[2], g[3]], draft_parents=[-1, -1, 0, 1, 3])
        chain = Verify(2, [g[1], g[2], g[3]])
        (t, c), _ = rt.step([tree, chain], [])
        assert t.code == Code.OK and t.tokens == g[1:5] and t.num_accepted == 3
        assert c.tokens == t.tokens and t.hidden.rows == c.hidden.rows == 4
        reader = open_reader(rt.writer.descriptor)
        rows_t = reader.read(t.hidden.offset, t.hidden.rows, t.hidden.inline).clone()
        rows_c = reader.read(c.hidden.offset, c.hidden.rows, c.hidden.inline).clone()
        reader.close()
        torch.testing.assert_close(rows_t, rows_c, rtol=1e-4, atol=1e-4)  # fp32, other batch shapes
        got = list(t.tokens)
        while len(got) < 9:
            (a, b), _ = rt.step([Verify(1, [], capture=False), Verify(2, [], capture=False)], [])
            assert a.tokens == b.tokens
            got += a.tokens
        assert got == g[1:10]
    finally:
        rt.close()


def test_target_rejects_bad_trees(tiny_target: Path) -> None:
    rt = runtime(tiny_target, max_context=64, max_sequences=2)
    try:
        rt.step([Prefill(1, [1, 2, 3]), Prefill(2, [1, 2, 3], Sampling(temperature=1.0, seed=1))], [])
        res, _ = rt.step([Verify(1, [4, 5], draft_parents=[-1, 1])], [])  # a parent after its child
        assert res[0].code == Code.INVALID_ARGUMENT and "before it" in res[0].message
        res, _ = rt.step([Verify(1, [4, 5], draft_parents=[-1])], [])
        assert res[0].code == Code.INVALID_ARGUMENT and "parents" in res[0].message
        res, _ = rt.step([Verify(2, [4, 5], [([4], [1.0]), ([5], [1.0])], draft_parents=[-1, -1])], [])
        assert res[0].code == Code.INVALID_ARGUMENT and "greedily" in res[0].message
        (ok,), _ = rt.step([Verify(1, [4], draft_parents=[-1])], [])  # the sequence is intact
        assert ok.code == Code.OK and len(ok.tokens) >= 1
    finally:
        rt.close()


@pytest.fixture(scope="module")
def tiny_engines(tiny_target: Path, tiny_head: Path) -> LocalEngines:
    engines = LocalEngines(TargetConfig(model=str(tiny_target), max_context=256, max_draft_tokens=32),
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), max_context=256))
    yield engines
    engines.close()


def test_draft_tree_of_topk_1_is_the_chain(tiny_engines: LocalEngines) -> None:
    """A one-way tree keeps the chain's tokens; wider trees keep num_draft_tokens - 1 distinct
    (parent, token) nodes, parents first."""
    draft, target = tiny_engines.draft, tiny_engines.target
    assert draft is not None
    (pre,), _ = target.step([Prefill(40, [5, 6, 7, 8])], [])
    tokens = [6, 7, 8, *pre.tokens]
    ref = pre.hidden

    def propose(seq_id: int, **kw: int) -> tuple[list[int], list[int]]:
        (r,), _ = draft.step([ExtendPropose(seq_id, tokens, HiddenRef(ref.offset, ref.rows, ref.generation), 5,
                                            **kw)])
        assert r.code == Code.OK, r.message
        return r.draft_ids, r.draft_parents

    chain, none = propose(41)
    one_way, parents = propose(42, topk=1, num_draft_tokens=6)
    assert none == [] and parents == [] and one_way == chain
    for k, n in [(2, 6), (4, 16), (8, 40)]:
        ids, parents = propose(43 + k, topk=k, num_draft_tokens=n)
        assert len(ids) == len(parents) == n - 1
        assert all(-1 <= p < i for i, p in enumerate(parents))
        assert len(set(zip(parents, ids, strict=True))) == len(ids)
        assert ids[0] == chain[0]  # the best first token heads the tree
    draft.step([Release(s) for s in (41, 42, 45, 47, 51)])
    target.step([Release(40)], [ref.generation])


@dataclass
class DraftTree:
    """One tree kept on the host, a level at a time: the reference grow_trees must match."""

    slot: int
    length: int  # committed draft entries; the tree's nodes follow
    topk: int
    keep: int  # draft tokens to keep (num_draft_tokens - 1)
    tokens: list[int] = field(default_factory=list)  # target ids, one per candidate node
    scores: list[float] = field(default_factory=list)  # cumulative log-probabilities
    parents: list[int] = field(default_factory=list)  # candidate index, -1 at depth 1
    depths: list[int] = field(default_factory=list)
    entries: dict[int, list[int]] = field(default_factory=dict)  # expanded node -> KV entries of it and its ancestors
    frontier: list[int] = field(default_factory=list)  # nodes to expand next
    next_entry: int = 0

    def __post_init__(self) -> None:
        self.next_entry = self.length

    def add(self, parent: int, tokens: list[int], logprobs: list[float]) -> None:
        """Candidates under `parent` (-1: the sequence) with their own log-probabilities."""
        base = self.scores[parent] if parent >= 0 else 0.0
        depth = self.depths[parent] + 1 if parent >= 0 else 1
        for t, lp in zip(tokens, logprobs, strict=True):
            self.tokens.append(t)
            self.scores.append(base + min(lp, 0.0))
            self.parents.append(parent)
            self.depths.append(depth)

    def choose_frontier(self, first: int) -> None:
        """Expand next the topk best of the candidates added since index `first`."""
        fresh = range(first, len(self.tokens))
        self.frontier = sorted(fresh, key=lambda i: (-self.scores[i], i))[: self.topk]

    def frontier_segment(self, device: torch.device | str = "cpu") -> Segment:
        """The frontier's nodes as one segment: written side by side after the entries used so
        far, at position length + depth - 1 (the chain's position for that depth); its tensors
        moved to `device` once."""
        n, start = len(self.frontier), self.next_entry
        visible = torch.zeros(n, start + n, dtype=torch.bool)  # [n, start + n]
        visible[:, : self.length] = True
        for j, node in enumerate(self.frontier):
            parent = self.parents[node]
            own = [*(self.entries[parent] if parent >= 0 else []), start + j]
            self.entries[node] = own
            visible[j, own] = True
        self.next_entry += n
        positions = torch.tensor([self.length + self.depths[i] - 1 for i in self.frontier])
        return Segment(self.slot, start, n, positions.to(device), visible.to(device))

    def result(self) -> tuple[list[int], list[int]]:
        """The kept draft tokens in creation order (parents first) and their parents' indices
        in that list (-1: a child of the sequence)."""
        best = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], self.depths[i], i))[: self.keep]
        kept = sorted(best)
        index = {node: j for j, node in enumerate(kept)}
        parents = [index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in kept]
        return [self.tokens[i] for i in kept], parents


class FakeHead:
    """A deterministic stand-in for the head's static forward over a 40-token vocabulary:
    logits from the token and the hidden input, a new hidden from both. Records each level's
    entries and masks."""

    def __init__(self, hidden: int = 6, vocab: int = 40) -> None:
        g = torch.Generator().manual_seed(7)
        self.tok, self.mix = torch.randn(vocab, vocab, generator=g), torch.randn(hidden, vocab, generator=g)
        self.emb = torch.randn(vocab, hidden, generator=g)
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                ctx: int, entries: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.append((positions, entries, None if visible is None else visible.clone()))  # (updated in place)
        draft_ids = (tokens - 1) // 3  # the head embeds target ids: back to this table's rows
        return self.tok[draft_ids] + hidden @ self.mix, torch.tanh(hidden + self.emb[draft_ids])

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids * 3 + 1  # a reduced vocabulary mapped into a wider one


def host_tree(head: FakeHead, logits: torch.Tensor, hidden: torch.Tensor, length: int, topk: int, steps: int,
              keep: int) -> tuple[DraftTree, list[Segment]]:
    """DraftTree grown for one sequence on FakeHead."""
    tree, segments = DraftTree(0, length, topk, keep), []
    top = torch.log_softmax(logits, -1).topk(topk)
    tree.add(-1, head.to_target_ids(top.indices).tolist(), top.values.tolist())
    tree.choose_frontier(0)
    inputs = hidden.expand(topk, -1)
    for _ in range(1, steps):
        segments.append(tree.frontier_segment())
        ids = torch.tensor([tree.tokens[i] for i in tree.frontier])
        out, prenorm = head.forward(ids[None], inputs[None], None, None, 0, None, None)
        head.seen.pop()
        top = torch.log_softmax(out[0], -1).topk(topk)
        first, rows = len(tree.tokens), {}
        for j, node in enumerate(tree.frontier):
            tree.add(node, head.to_target_ids(top.indices[j]).tolist(), top.values[j].tolist())
            rows[node] = j
        tree.choose_frontier(first)
        inputs = prenorm[0][[rows[tree.parents[i]] for i in tree.frontier]]
    return tree, segments


@pytest.mark.parametrize("topk,steps", [(1, 4), (2, 1), (3, 4), (4, 5)])
def test_static_tree_growth_builds_the_host_trees(topk: int, steps: int) -> None:
    """grow_trees (tensors only, what one CUDA graph captures) gives DraftTree's trees:
    the same candidates, parents, order, rotary positions, KV entries and attention masks."""
    head, g = FakeHead(), torch.Generator().manual_seed(topk * 10 + steps)
    lengths, ctx = torch.tensor([5, 9, 1]), 40
    logits, hidden = torch.randn(3, 40, generator=g), torch.randn(3, 6, generator=g)
    tokens, parents, order = grow_trees(head.forward, head.to_target_ids, logits, hidden, lengths,
                                               torch.tensor([2, 0, 1]), topk, steps, ctx)
    assert tokens.shape == parents.shape == order.shape == (3, topk + (steps - 1) * topk * topk)
    levels = head.seen
    for b, length in enumerate(lengths.tolist()):
        for keep in (2, 7, 100):
            tree, segments = host_tree(head, logits[b], hidden[b], length, topk, steps, keep)
            assert tokens[b].tolist() == tree.tokens and parents[b].tolist() == tree.parents
            for cut in range(1, steps + 1):  # a row of a batch grown deeper than its own num_steps
                short, _ = host_tree(head, logits[b], hidden[b], length, topk, cut, keep)
                assert tree_result(tokens[b].tolist(), parents[b].tolist(), order[b].tolist(), topk, cut,
                                          keep) == short.result()
        for (positions, entries, visible), seg in zip(levels, segments, strict=True):
            assert positions[b].tolist() == seg.positions.tolist()
            assert entries[b].tolist() == list(range(seg.start, seg.start + seg.length))
            width = seg.visible.shape[1]
            assert torch.equal(visible[b, :, :width], seg.visible) and not visible[b, :, width:].any()


def test_static_and_eager_drafts_grow_the_same_trees(tiny_engines: LocalEngines) -> None:
    """The draft engine's padded static path (CUDA's) and its eager path propose the same trees
    and chains, also with trees of two widths and a chain in one batch."""
    draft, target = tiny_engines.draft, tiny_engines.target
    assert draft is not None
    (pre,), _ = target.step([Prefill(70, [5, 6, 7, 8])], [])
    tokens, ref = [6, 7, 8, *pre.tokens], pre.hidden
    shapes = [dict(topk=4, num_draft_tokens=16, num_steps=5), dict(topk=2, num_draft_tokens=6, num_steps=3),
              dict(num_steps=4), dict(topk=4, num_draft_tokens=9, num_steps=2)]
    proposals = []
    for static, base in ((False, 71), (True, 81)):
        draft.engine.runner.padded = static
        try:
            ops = [ExtendPropose(base + i, tokens, HiddenRef(ref.offset, ref.rows, ref.generation), **kw)
                   for i, kw in enumerate(shapes)]
            results, _ = draft.step(ops)
            assert all(r.code == Code.OK for r in results), [r.message for r in results]
            proposals.append([(r.draft_ids, r.draft_parents) for r in results])
        finally:
            draft.engine.runner.padded = False
            draft.step([Release(base + i) for i in range(len(shapes))])
    draft.engine.runner.padded = True
    try:  # a sampled chain in the batch (its own loop on the host) leaves the others' proposals as they were
        ops = [ExtendPropose(91 + i, tokens, HiddenRef(ref.offset, ref.rows, ref.generation), **kw)
               for i, kw in enumerate([*shapes, dict(num_steps=3, sampling=Sampling(temperature=0.8, seed=5))])]
        results, _ = draft.step(ops)
    finally:
        draft.engine.runner.padded = False
        draft.step([Release(91 + i) for i in range(len(ops))])
    # batches of one topk take the fused path (extend and growth in one function): the same proposals
    fused = []
    for group in ([shapes[0]], [shapes[2]], [shapes[0], shapes[3]]):
        draft.engine.runner.padded = True
        try:
            ops = [ExtendPropose(101 + i, tokens, HiddenRef(ref.offset, ref.rows, ref.generation), **kw)
                   for i, kw in enumerate(group)]
            fused.append([(r.draft_ids, r.draft_parents) for r in draft.step(ops)[0]])
        finally:
            draft.engine.runner.padded = False
            draft.step([Release(101 + i) for i in range(len(group))])
    target.step([Release(70)], [ref.generation])
    assert proposals[0] == proposals[1] == [(r.draft_ids, r.draft_parents) for r in results[:-1]]
    assert [len(ids) for ids, _ in proposals[1]] == [15, 5, 4, 8]
    assert len(results[-1].draft_ids) == len(results[-1].draft_dists) == 3 and not results[-1].draft_parents
    assert fused == [[proposals[0][0]], [proposals[0][2]], [proposals[0][0], proposals[0][3]]]


def test_draft_rejects_bad_tree_requests(tiny_engines: LocalEngines) -> None:
    draft = tiny_engines.draft
    assert draft is not None
    ref = HiddenRef(0, 1, 0, inline=b"")
    cases = {"topk 99 is outside": dict(topk=99, num_draft_tokens=8),
             "outside 2..": dict(topk=4, num_draft_tokens=1),
             "greedy sequences only": dict(topk=4, num_draft_tokens=8, sampling=Sampling(temperature=1.0))}
    for message, kw in cases.items():
        (r,), _ = draft.step([ExtendPropose(60, [1], ref, 3, **kw)])
        assert r.code == Code.INVALID_ARGUMENT and message in r.message, r.message


@pytest.mark.parametrize("topk,num_draft_tokens", [(2, 6), (4, 16)])
def test_tiny_trees_are_lossless(tiny_engines: LocalEngines, topk: int, num_draft_tokens: int) -> None:
    base = tiny_engines.generate([GenerationRequest(p, 40, Sampling(), {511}, 0) for p in TINY_PROMPTS])
    for steps in (1, 3, 6):
        spec = tiny_engines.generate([GenerationRequest(p, 40, Sampling(), {511}, steps, topk, num_draft_tokens)
                                      for p in TINY_PROMPTS])
        assert [s.tokens for s in spec] == [b.tokens for b in base], f"steps {steps}"
    assert tiny_engines.target.stats()["active_sequences"] == 0


@pytest.mark.slow
def test_smollm2_trees_with_the_shipped_head_are_lossless_and_accept_more(smollm2_dir: Path) -> None:
    engines = LocalEngines(TargetConfig(model=str(smollm2_dir), max_context=512, dtype="float32"),
                           DraftConfig(head="default", target=str(smollm2_dir), max_context=512))
    try:
        codec = TextCodec.from_checkpoint(smollm2_dir)
        prompts = [codec.encode(codec.render_chat(p)) for p in CHAT_PROMPTS]
        base = engines.generate([GenerationRequest(p, 48, Sampling(), {2}, 0) for p in prompts])
        chain = engines.generate([GenerationRequest(p, 48, Sampling(), {2}, 4) for p in prompts])
        tree = engines.generate([GenerationRequest(p, 48, Sampling(), {2}, 4, 4, 16) for p in prompts])
        assert [r.tokens for r in tree] == [r.tokens for r in base] == [r.tokens for r in chain]

        def tau(rs: list) -> float:
            return sum(k * v for r in rs for k, v in r.stats.histogram.items()) / sum(r.stats.cycles for r in rs)

        assert tau(tree) > tau(chain) > 1.5
    finally:
        engines.close()


def test_request_tree_shape_validation() -> None:
    cfg, limits = GatewayConfig(default_topk=4).validate(), ModelLimits(512, 2048, [2], True, max_draft_tokens=16)
    assert tree_shape(None, None, cfg, limits, 5, 0.0) == (4, 16)  # greedy: the default tree
    assert tree_shape(None, None, cfg, limits, 5, 0.7) == (1, 6)  # sampled: a chain
    assert tree_shape(1, None, cfg, limits, 3, 0.0) == (1, 4)
    assert tree_shape(2, None, cfg, limits, 1, 0.0) == (2, 3)  # one level of two: at most 3 counting the root
    assert tree_shape(8, 9, cfg, limits, 0, 0.0) == (1, 1)  # speculation off
    for args, message in [((4, None, 5, 0.7), "needs greedy"), ((9, None, 5, 0.0), "topk must be within"),
                          ((4, 17, 5, 0.0), "within 2..16"), ((4, 1, 5, 0.0), "within 2..16"),
                          ((1, 9, 5, 0.0), "num_draft_tokens = 6")]:
        topk, n, steps, temperature = args
        with pytest.raises(InvalidRequest, match=message):
            tree_shape(topk, n, cfg, limits, steps, temperature)


def test_draft_runtime_reports_max_topk(tiny_target: Path, tiny_head: Path) -> None:
    rt = DraftRuntime(DraftConfig(head=str(tiny_head), target=str(tiny_target), max_context=64, max_topk=3).validate())
    assert rt.engine.max_topk == 3


class FailingDraft:
    """A draft client whose every proposal fails for the sequence (an engine error each cycle)."""

    def __init__(self, inner: object) -> None:
        self.inner, self.calls = inner, 0

    async def step(self, ops: list, timeout: float = 0.0, meanwhile: Meanwhile = None) -> tuple[list, object]:
        results, timing = await self.inner.step(ops, meanwhile=meanwhile)
        self.calls += 1
        for r in results:
            if r.code == Code.OK and ops and isinstance(ops[0], ExtendPropose):
                r.code, r.message, r.draft_ids = Code.INTERNAL, "injected failure", []
        return results, timing

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_a_draft_failing_every_cycle_leaves_the_sequence_target_only(tiny_engines: LocalEngines) -> None:
    """No livelock: after MAX_DRAFT_FAILURES failures in a row the sequence decodes target-only."""
    from gateway.clients import LocalDraft
    from gateway.phases import MAX_DRAFT_FAILURES

    assert tiny_engines.draft is not None
    base = tiny_engines.generate([GenerationRequest(TINY_PROMPTS[0], 30, Sampling(), {511}, 0)])
    failing = FailingDraft(LocalDraft(tiny_engines.draft))
    (out,) = tiny_engines.generate([GenerationRequest(TINY_PROMPTS[0], 30, Sampling(), {511}, 3)], failing)
    assert out.tokens == base[0].tokens and failing.calls <= MAX_DRAFT_FAILURES + 2
    assert tiny_engines.draft.stats()["active_sequences"] == 0


def test_static_tree_verify_equals_the_segment_path(tiny_target: Path) -> None:
    """The padded static batch (what CUDA graphs capture) holding a tree and a chain gives the
    segment path's tokens, and the sequences go on alike."""
    prompt = [3, 14, 15, 92, 65]
    g = greedy_continuation(tiny_target, prompt, 10)
    wrong = (g[1] + 1) % 512
    outs = []
    for static in (False, True):
        rt = runtime(tiny_target, max_context=64, max_draft_tokens=8, max_sequences=2)
        rt.engine.runner.padded = static
        try:
            rt.step([Prefill(1, prompt), Prefill(2, [7, 7, 7])], [])
            (t, c), _ = rt.step([Verify(1, [wrong, g[1], g[3], g[2], g[3]], draft_parents=[-1, -1, 0, 1, 3]),
                                 Verify(2, [7, 7])], [])
            got = [t.tokens, c.tokens]
            for _ in range(4):
                (a, b), _ = rt.step([Verify(1, [], capture=False), Verify(2, [], capture=False)], [])
                got += [a.tokens, b.tokens]
            outs.append(got)
        finally:
            rt.close()
    assert outs[0] == outs[1] and outs[0][0] == g[1:5]


def test_static_engines_trees_are_lossless(tiny_target: Path, tiny_head: Path) -> None:
    engines = LocalEngines(TargetConfig(model=str(tiny_target), max_context=256, max_draft_tokens=32),
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), max_context=256))
    try:
        assert engines.draft is not None
        engines.target.engine.runner.padded = engines.draft.engine.runner.padded = True
        base = engines.generate([GenerationRequest(p, 30, Sampling(), {511}, 0) for p in TINY_PROMPTS])
        mixed = engines.generate([GenerationRequest(p, 30, Sampling(), {511}, s, k, n) for p, s, k, n in
                                  zip(TINY_PROMPTS, [3, 5, 2, 4], [4, 1, 2, 8], [16, 0, 5, 32], strict=True)])
        assert [r.tokens for r in mixed] == [r.tokens for r in base]
        one_topk = engines.generate([GenerationRequest(p, 30, Sampling(), {511}, s, 4, 16) for p, s in
                                     zip(TINY_PROMPTS, [3, 5, 2, 4], strict=True)])  # the fused extend + growth
        assert [r.tokens for r in one_topk] == [r.tokens for r in base]
    finally:
        engines.close()


def test_a_draft_narrower_than_the_gateways_max_topk_is_not_used() -> None:
    import asyncio
    from types import SimpleNamespace

    from gateway.recovery import Recovery
    from specsplit.v1 import draft_pb2

    class Draft:
        def __init__(self, max_topk: int) -> None:
            self.info = draft_pb2.DraftInfo(max_steps=8, max_topk=max_topk, max_sequences=4, head_name="h")

        async def attach(self, store: object, timeout: float) -> draft_pb2.DraftInfo:
            return self.info

        def use_step_transport(self, socket: str) -> str:
            return "grpc stream"

    for max_topk, usable in ((2, False), (8, True)):
        scheduler = SimpleNamespace(draft=object(), max_sequences=8, limits=SimpleNamespace(draft_ahead=False))
        recovery = Recovery(scheduler, None, Draft(max_topk), None, [], 8, 1.0, max_topk=8)
        assert asyncio.run(recovery.attach_draft()) is usable
        assert (scheduler.draft is None) is not usable


@pytest.mark.parametrize("shape", [(3, 8192), (2, 4, 8192), (2, 32000), (1, 5000), (2, 40), (1, 1999)])
def test_top_log_probs_by_slices_match_a_whole_row_top_k(shape: tuple[int, ...]) -> None:
    """The draft's two-stage top-k (slices of the vocabulary, then their best) returns what a
    top-k of the whole row's log-probabilities returns, values and indices, largest first."""
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1]))
    for k in (1, 2, 4, 8):
        values, ids = top_log_probs(logits, k)
        want = torch.log_softmax(logits, -1).topk(k)
        assert torch.equal(values, want.values) and torch.equal(ids, want.indices)


@pytest.mark.gpu
@pytest.mark.quick
@needs_gpus(1)
@pytest.mark.parametrize("shape", [(1, 8192), (4, 8192), (2, 4, 8192), (3, 40), (2, 16384), (5, 1000)])
def test_fused_top_k_matches_log_softmax_top_k_on_the_gpu(shape: tuple[int, ...]) -> None:
    """The draft's one-kernel log-softmax + top-k: the indices of log_softmax + topk, and its
    log-probabilities to fp32 rounding; the engine takes it on CUDA."""
    fused = fused_top_k(torch.device("cuda"))
    assert fused is not None
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1])).cuda() * 4
    for k in (1, 2, 4, 8):
        if k > shape[-1]:
            continue
        values, ids = top_log_probs(logits, k, fused)
        want = torch.log_softmax(logits, -1).topk(k)
        assert torch.equal(ids, want.indices)
        torch.testing.assert_close(values, want.values, rtol=1e-5, atol=1e-5)  # sums in another order
