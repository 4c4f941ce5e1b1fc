"""CUDA graphs: replaying a captured static batch gives exactly what running it eagerly gives.

On CUDA both modes run the padded batches (`ModelRunner.padded_forward`), so their kernels are the
same and the outputs must be bitwise equal; greedy speculation with graphs must still equal
target-only decoding.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from bench.replay import ReplayDraft, Replayer
from draft_service.config import DraftConfig
from gateway.clients import LocalDraft
from gateway.local import LocalEngines
from gateway.scheduler import GenerationRequest
from specsplit.checkpoints.target_checkpoint import load_safetensors_dir, load_target_config
from specsplit.cli.client import make_request
from specsplit.cli.launcher import StackConfig
from specsplit.models.batch import Batch
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import TensorParallel
from specsplit.ops import Sampling
from specsplit.runner.graphs import GraphCache
from target_service.config import TargetConfig
from tests.test_gpu_services import TINY_PROMPTS, needs_gpus, run_stack

pytestmark = pytest.mark.gpu
SMOLLM2_GGUF = os.environ.get("SPECSPLIT_SMOLLM2_GGUF", "/root/stage/smollm2.gguf")


def engines(target: Path | str, head: Path | str, graphs: bool, dtype: str = "bfloat16") -> LocalEngines:
    return LocalEngines(TargetConfig(model=str(target), device="cuda", dtype=dtype, hidden_backend="cuda_ipc",
                                     max_context=512, cuda_graphs=graphs, fused_decode="off"),  # the padded path
                        DraftConfig(head=str(head), target=str(target), device="cuda", dtype=dtype,
                                    max_context=512, cuda_graphs=graphs))


def greedy(e: LocalEngines, prompts: list[list[int]], steps: int, rate: float | None = None,
           refs: list[list[int]] | None = None) -> list[list[int]]:
    vocab = e.target.model.cfg.vocab_size
    draft = ReplayDraft(LocalDraft(e.draft), Replayer(refs or [], rate, vocab)) if rate else None
    return [r.tokens for r in e.generate([GenerationRequest(p, 32, Sampling(), set(), steps) for p in prompts],
                                         draft)]


@needs_gpus(1)
def test_model_graph_replay_is_bitwise_equal_to_eager(tiny_target: Path) -> None:
    cfg = load_target_config(tiny_target)
    dev = torch.device("cuda")
    with dev:
        model = LlamaModel(cfg, TensorParallel(), cfg.default_aux_layer_ids())
    model.load_full_weights(load_safetensors_dir(tiny_target))
    model = model.to(torch.bfloat16).eval()
    outs = []
    for enabled in (False, True):
        cache = model.new_cache(4, 256)
        graphs = GraphCache(dev, enabled)
        got = []
        for step, (b, t) in enumerate([(1, 1), (1, 1), (4, 5), (2, 3), (4, 5), (1, 1)]):
            g = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, cfg.vocab_size, (b, t), generator=g).to(dev)
            positions = (torch.arange(t)[None] + torch.tensor([20 * i + step for i in range(b)])[:, None]).to(dev)
            slots = torch.arange(b, device=dev)

            def fn(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache=cache) -> tuple:  # noqa: ANN001
                return model(tokens.view(-1), Batch.padded(positions, slots, positions, 128, capture=True), cache)

            with torch.inference_mode():
                logits, aux = graphs.run((b, t), fn, tokens=tokens, positions=positions, slots=slots)
                got.append((logits.clone(), aux.clone()))
        if enabled:
            assert len(graphs.graphs) == 3 and graphs.replays == 6
        outs.append((got, cache.k.clone()))
    (eager, k_eager), (graph, k_graph) = outs
    for (le, ae), (lg, ag) in zip(eager, graph, strict=True):
        assert torch.equal(le, lg) and torch.equal(ae, ag)
    assert torch.equal(k_eager, k_graph)


@needs_gpus(1)
def test_engines_with_and_without_graphs_give_identical_tokens(tiny_target: Path, tiny_head: Path) -> None:
    results = {}
    for graphs in (False, True):
        e = engines(tiny_target, tiny_head, graphs)
        try:
            base = greedy(e, TINY_PROMPTS, 0)
            refs = [p + b for p, b in zip(TINY_PROMPTS, base, strict=True)]
            results[graphs] = (base, greedy(e, TINY_PROMPTS, 4), greedy(e, TINY_PROMPTS, 5, 0.8, refs))
            if graphs:
                assert e.target.engine.runner.graphs.replays > 0 and e.draft.engine.runner.graphs.replays > 0
            else:
                assert not e.target.engine.runner.graphs.graphs and not e.draft.engine.runner.graphs.graphs
            assert e.target.stats()["active_sequences"] == 0
        finally:
            e.close()
    assert results[True] == results[False]
    base, spec, replayed = results[True]
    assert spec == base and replayed == base  # bf16 speculation with graphs is lossless too


@needs_gpus(1)
def test_trees_with_and_without_graphs_give_identical_tokens(tiny_target: Path, tiny_head: Path) -> None:
    """Tree verifies run in graphs of their own key and the draft grows all of a tree's levels
    (and a greedy chain's steps) in one graph; the trees and tokens equal the eager run's and target-only decoding's."""
    class Recording(LocalDraft):
        seen: list[tuple[list[int], list[int]]]

        async def step(self, ops, timeout=0.0, meanwhile=None):  # noqa: ANN001, ANN202
            results, timing = await super().step(ops, meanwhile=meanwhile)
            self.seen.extend((r.draft_ids, r.draft_parents) for r in results)
            return results, timing

    results = {}
    for graphs in (False, True):
        e = engines(tiny_target, tiny_head, graphs)
        try:
            base = greedy(e, TINY_PROMPTS, 0)
            recording = Recording(e.draft)
            recording.seen = []
            trees = [r.tokens for r in e.generate([GenerationRequest(p, 32, Sampling(), set(), s, k, n) for p, s, k, n
                                                   in zip(TINY_PROMPTS, [3, 5, 2, 4], [4, 2, 8, 1], [16, 8, 12, 0],
                                                          strict=True)], recording)]
            results[graphs] = (base, trees, recording.seen)
            if graphs:
                assert any(key[0] == "grow" for key in e.draft.engine.runner.graphs.graphs)
        finally:
            e.close()
    assert results[True] == results[False]
    assert results[True][1] == results[True][0]
    assert any(parents for _, parents in results[True][2])


@pytest.mark.quick
@needs_gpus(1)
def test_draft_proposals_with_and_without_graphs_are_identical(tiny_target: Path, tiny_head: Path) -> None:
    """The draft's proposals (not only the target's tokens) do not depend on graphs."""
    class Recording(LocalDraft):
        seen: list[list[int]]

        async def step(self, ops, timeout=0.0, meanwhile=None):  # noqa: ANN001, ANN202
            results, timing = await super().step(ops, meanwhile=meanwhile)
            self.seen.extend(r.draft_ids for r in results)
            return results, timing

    proposals = {}
    for graphs in (False, True):
        e = engines(tiny_target, tiny_head, graphs)
        recording = Recording(e.draft)
        recording.seen = proposals[graphs] = []
        try:
            e.generate([GenerationRequest(p, 24, Sampling(), set(), s) for p, s in zip(TINY_PROMPTS, [1, 3, 5, 7],
                                                                                    strict=True)], recording)
        finally:
            e.close()
    assert proposals[True] == proposals[False] and len(proposals[True]) > 8


@needs_gpus(1)
def test_smollm2_bf16_graphs_identical_and_fp32_lossless(tiny_head: Path) -> None:
    if not Path(SMOLLM2_GGUF).exists():
        pytest.skip(f"SmolLM2 GGUF not at {SMOLLM2_GGUF} (set SPECSPLIT_SMOLLM2_GGUF)")
    from specsplit.checkpoints.target_checkpoint import resolve_target_dir
    from specsplit.tokenizer import TextCodec

    codec = TextCodec.from_checkpoint(resolve_target_dir(SMOLLM2_GGUF))
    prompts = [codec.encode(codec.render_chat(p)) for p in ("What is the capital of France?",
                                                            "Write a haiku about the sea.")]
    out = {}
    for graphs, dtype in ((False, "bfloat16"), (True, "bfloat16"), (True, "float32")):
        e = engines(SMOLLM2_GGUF, "random", graphs, dtype)
        try:
            base = greedy(e, prompts, 0)
            refs = [p + b for p, b in zip(prompts, base, strict=True)]
            out[graphs, dtype] = (base, greedy(e, prompts, 5, 0.85, refs))
        finally:
            e.close()
    assert out[True, "bfloat16"] == out[False, "bfloat16"]
    base, replayed = out[True, "float32"]
    assert replayed == base


@needs_gpus(2)
def test_tp2_services_graphs_equal_eager(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    """NCCL all-reduces and all-gathers inside captured graphs on both ranks."""
    specs = [([1, 2, 3], 3), ([5] * 12, 0), (list(range(30, 70)), 5)]
    reqs = [make_request(token_ids=p, max_new_tokens=24, num_steps=s) for p, s in specs]
    base = dict(model=str(tiny_target), head=str(tiny_head), max_context=256, dtype="bfloat16",
                hidden_backend="cuda_ipc", draft_device="cuda:0", device="cuda", tp_size=2)
    eager = run_stack(StackConfig.of(**base, extra_target_args=["--no-cuda-graphs"],
                                     extra_draft_args=["--no-cuda-graphs"], log_dir=tmp_path / "eager"), reqs)
    graphs = run_stack(StackConfig.of(**base, log_dir=tmp_path / "graphs"), reqs)
    assert all(len(t) == 24 for t in graphs)
    assert graphs == eager


@needs_gpus(2)
def test_in_process_target_and_draft_on_different_gpus(tiny_target: Path, tiny_head: Path) -> None:
    """Graphs are captured on each engine's own GPU, whatever the caller's current device."""
    outs = []
    for target_dev, draft_dev in (("cuda:0", "cuda:0"), ("cuda:1", "cuda:0"), ("cuda:0", "cuda:1")):
        e = LocalEngines(TargetConfig(model=str(tiny_target), device=target_dev, dtype="bfloat16",
                                      hidden_backend="cuda_ipc", max_context=512, fused_decode="off"),
                         DraftConfig(head=str(tiny_head), target=str(tiny_target), device=draft_dev,
                                     dtype="bfloat16", max_context=512))
        try:
            base = greedy(e, TINY_PROMPTS, 0)
            refs = [p + b for p, b in zip(TINY_PROMPTS, base, strict=True)]
            outs.append((base, greedy(e, TINY_PROMPTS, 4, 0.8, refs)))
            assert e.target.engine.runner.graphs.replays > 0 and e.draft.engine.runner.graphs.replays > 0
        finally:
            e.close()
    assert outs[0] == outs[1] == outs[2]
    assert outs[0][0] == outs[0][1]


@pytest.mark.quick
@needs_gpus(1)
def test_prompt_steps_replay_graphs_bitwise_equal_to_eager(tiny_target: Path) -> None:
    """Steps of prompts (rows from entry 0) replay one graph per shape: logits, features, argmax and
    KV entries bitwise those of the same steps run eagerly; a shape's second step in one call
    keeps the first one's outputs; longer steps than GRAPH_TOKENS run eagerly."""
    from specsplit.runner.packing import Row
    from specsplit.runner.prompts import GRAPH_TOKENS
    from specsplit.runner.runner import ModelRunner, Step

    cfg = load_target_config(tiny_target)
    with torch.device("cuda"):
        model = LlamaModel(cfg, TensorParallel(), cfg.default_aux_layer_ids())
    model.load_full_weights(load_safetensors_dir(tiny_target))
    model = model.eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 30, 9, 40, 7)]
    outs = []
    for enabled in (False, True):
        runner = ModelRunner(model, 8, 2 * GRAPH_TOKENS, cuda_graphs=enabled)
        got = []
        for rows in ([0], [1, 2, 3], [0, 1, 2, 3, 4, 5], [5]):
            verified = runner.verify(Step([Row(i, 0, prompts[i]) for i in rows], capture=True))
            got += [(v.logits.clone(), v.features.clone(), v.best) for v in verified]  # type: ignore[union-attr]
        long = runner.run(Step([Row(6, 0, [3] * (GRAPH_TOKENS + 10))], capture=True))
        got.append((long[0][0].clone(), long[0][1].clone(), []))  # type: ignore[union-attr]
        if enabled:
            assert runner.graphs.replays > 0 and all(k[2] * k[1] <= GRAPH_TOKENS for k in runner.graphs.graphs
                                                     if k[0] == "prompts")
        outs.append((got, runner.cache.k[:, :7].clone()))
    (eager, k_eager), (graph, k_graph) = outs
    for (le, fe, be), (lg, fg, bg) in zip(eager, graph, strict=True):
        assert torch.equal(le, lg) and torch.equal(fe, fg) and be == bg
    assert torch.equal(k_eager, k_graph)


@pytest.mark.quick
@needs_gpus(1)
def test_a_capture_survives_the_collector_freeing_a_dropped_graph() -> None:
    """A graph dropped in a reference cycle is torn down whenever Python's collector runs; one
    that would run during a capture (here: cyclic garbage holding a graph, and a collection
    threshold of one allocation) must wait until the capture ends."""
    import gc

    x = torch.ones(8, device="cuda")
    old = GraphCache(torch.device("cuda"))
    old.run(("old",), lambda x: (x * 2,), x=x)
    held = [old]
    del old

    def fn(x: torch.Tensor) -> tuple[torch.Tensor]:
        if held and torch.cuda.is_current_stream_capturing():
            cycle: dict[str, object] = {"graphs": held.pop()}
            cycle["self"] = cycle
            del cycle
            _ = [[] for _ in range(2000)]  # allocations: the collector's threshold is crossed
        return (x + 1,)

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        (out,) = GraphCache(torch.device("cuda")).run(("new",), fn, x=x)
        torch.cuda.synchronize()
    finally:
        gc.set_threshold(*threshold)
    assert not held and torch.equal(out, x + 1)
    gc.collect()  # the dropped graph is freed after the capture
