"""The fused steps (specsplit.models.fused): one-token decode and multi-row verify
(chains and trees), their logits, features and KV entries against the static path's from CUDA
graphs, with and without programmatic dependent launch; the target engine serving them; and the
configurations they refuse."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from draft_service.config import DraftConfig
from gateway.local import LocalEngines
from gateway.scheduler import GenerationRequest
from specsplit.checkpoints.shapes import SHAPES
from specsplit.checkpoints.tiny import tiny_config
from specsplit.models.batch import Batch, tree_layout
from specsplit.models.fused import FusedLlama, fused_decode_unsupported, pdl_pays
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import TensorParallel
from specsplit.ops import Prefill, Sampling, Verify
from specsplit.runner.graphs import GraphCache
from specsplit.runner.runner import ModelRunner, Row, Step
from target_service.config import TargetConfig
from target_service.engine import TargetEngine, fused_runs
from target_service.runtime import build_model
from tests.test_gpu_services import TINY_PROMPTS, needs_gpus


def test_config_refuses_fused_decode_off_cuda() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        TargetConfig(fused_decode="on").validate()
    assert TargetConfig(device="cuda", tp_size=2, fused_decode="pdl").validate().tp_size == 2
    with pytest.raises(ValueError, match="fused_decode 'yes' not in"):
        TargetConfig(device="cuda", fused_decode="yes").validate()
    assert TargetConfig(device="cuda:1", fused_decode="pdl").validate().fused_decode == "pdl"
    assert TargetConfig().validate().fused_decode == "auto"  # the default: the fused step wherever it runs


def test_config_bounds_few_rows() -> None:
    assert TargetConfig(few_rows=8).validate().few_rows == 8 and TargetConfig().validate().few_rows == -1
    for bad in (-2, 9):
        with pytest.raises(ValueError, match=f"few_rows {bad} not within -1"):
            TargetConfig(few_rows=bad).validate()


def test_auto_serves_the_padded_path_where_the_fused_step_cannot_run(tiny_target: Path) -> None:
    engine = TargetEngine(TargetConfig(model=str(tiny_target)), build_model(TargetConfig(model=str(tiny_target)),
                                                                          TensorParallel()))
    assert engine.cfg.fused_decode == "auto" and engine.runner.fused is None  # the CPU
    model = LlamaModel(dataclasses.replace(tiny_config(layers=1), attention_bias=True), TensorParallel(), [0])
    assert not fused_runs(model)


def test_pdl_pays_for_decodes_and_for_small_models_rows() -> None:
    hopper, ampere = (9, 0), (8, 0)
    smollm2, llama8b = SHAPES["smollm2-135m"].hidden_size, SHAPES["llama-3.1-8b"].hidden_size
    assert all(pdl_pays(smollm2, rows, hopper) for rows in (1, 4, 16, 64))
    assert pdl_pays(llama8b, 1, hopper) and not pdl_pays(llama8b, 16, hopper)
    assert not pdl_pays(smollm2, 1, ampere)


def test_the_few_rows_default_is_the_gpu_models_measured_choice() -> None:
    from specsplit.models.fused import FEW_ROWS_DEFAULT, FEW_ROWS_HIDDEN, few_rows_default

    assert few_rows_default(576, gpu="NVIDIA H100 80GB HBM3") == 4  # 4 rows beat the tensor-core tiles there
    assert few_rows_default(576, gpu="NVIDIA H200") == FEW_ROWS_DEFAULT == 3
    assert few_rows_default(576) == FEW_ROWS_DEFAULT
    assert few_rows_default(576, 2, gpu="NVIDIA H100 80GB HBM3") == 2
    assert few_rows_default(FEW_ROWS_HIDDEN + 64, gpu="NVIDIA H100 80GB HBM3") == 0


def test_models_the_fused_step_cannot_run_are_refused_with_the_reason() -> None:
    def model(tp: TensorParallel = TensorParallel(), **changes: object) -> LlamaModel:  # noqa: B008
        return LlamaModel(dataclasses.replace(tiny_config(layers=1), **changes), tp, [0])

    assert fused_decode_unsupported(model()) is None
    assert fused_decode_unsupported(model(TensorParallel(1, 2))) is None  # each rank its shard
    assert "biases" in str(fused_decode_unsupported(model(attention_bias=True)))
    assert "q/k norms" in str(fused_decode_unsupported(model(qk_norm=True)))
    assert "power-of-two head_dim" in str(fused_decode_unsupported(model(head_dim=24)))
    assert "head_dim in 16..256" in str(fused_decode_unsupported(model(head_dim=8)))
    with pytest.raises(ValueError, match="biases"):
        FusedLlama(model(attention_bias=True))


class PaddedAsFused:
    """Stands in for FusedLlama on the CPU (no Triton): the batch the runner packs for a fused
    step (tokens, rotary positions, KV entries, slots, the [B, T, T] masks) run by the model itself
    as a padded batch, so the packing is checked wherever the tests run."""

    max_rows, max_seq_rows = 256, 64  # as FusedLlama's
    few_rows = 3  # FusedLlama's default at SmolLM2's size: batches up to 3 run unpadded

    def __init__(self, model: LlamaModel) -> None:
        self.model, self.rows = model, []

    def takes(self, b: int, t: int) -> bool:
        return b * t <= self.max_rows and t <= self.max_seq_rows

    def forward(self, tokens: torch.Tensor, batch: Batch, cache: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert batch.entries is not None and batch.slots is not None and batch.tree_mask is not None
        b, t = batch.entries.shape
        self.rows.append((b, t))
        starts = batch.entries[:, :1]
        assert torch.equal(batch.entries, starts + torch.arange(t)) and batch.tree_mask.shape == (b, t, t)
        padded = Batch.padded(batch.positions.view(b, t), batch.slots, batch.entries, int(starts.max()) + t,
                              batch.tree_mask, capture=batch.capture)
        return self.model(tokens, padded, cache)  # type: ignore[arg-type]


def test_engine_packs_fused_steps_as_the_static_path_runs_them(tiny_target: Path, tiny_head: Path) -> None:
    """CPU: the engine's fused-step inputs (one packed tensor: tokens, rotary positions, KV
    entries, slots, masks) describe the static path's step — decode, chains and trees give
    target-only decoding's tokens, alone, two sequences a step (padded to the longest row) and eight
    trees a step (128 rows)."""
    e = LocalEngines(TargetConfig(model=str(tiny_target), max_context=256),
                     DraftConfig(head=str(tiny_head), target=str(tiny_target), max_context=256))
    try:
        assert e.draft is not None
        e.target.engine.runner.padded = e.draft.engine.runner.padded = True

        def run(steps: int, topk: int = 1) -> list[list[int]]:
            return [e.generate([GenerationRequest(p, 16, Sampling(), set(), steps, topk, 8 if topk > 1 else 0)]
                               )[0].tokens for p in TINY_PROMPTS[:2]]

        static = run(0)
        fused = e.target.engine.runner.fused = PaddedAsFused(e.target.model)  # type: ignore[assignment]
        assert run(0) == run(3) == run(3, topk=3) == static
        assert {(1, 1), (1, 4), (1, 8)} <= set(fused.rows)
        fused.rows.clear()
        for steps in (0, 3):
            both = e.generate([GenerationRequest(p, 8, Sampling(), set(), steps) for p in TINY_PROMPTS[:2]])
            assert [r.tokens for r in both] == [x[:8] for x in static]
        assert {(2, 1), (2, 4)} <= set(fused.rows)  # two sequences a step: fused together
        trees = [GenerationRequest(p, 16, Sampling(), set(), 5, 4, 16) for p in TINY_PROMPTS]
        alone = [e.generate([r])[0].tokens for r in trees]
        assert [r.tokens for r in e.generate(trees + trees)] == alone + alone and alone[:2] == static
        assert (8, 16) in fused.rows  # eight trees of 16 tokens: 128 rows, two row tiles, in one fused step
    finally:
        e.close()


DEV = "cuda"  # the Triton interpreter (TRITON_INTERPRET=1) runs these kernels on "cpu"


def _random_model(cfg: object, dtype: torch.dtype) -> LlamaModel:
    torch.manual_seed(0)
    with torch.device(DEV):
        model = LlamaModel(cfg, TensorParallel(), [0, 1, 2]).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model.to(dtype)


@pytest.mark.quick
@pytest.mark.gpu
@needs_gpus(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_fused_step_matches_the_static_path(dtype: torch.dtype, pdl: bool) -> None:
    """SmolLM2's shape (3 layers): 40 decode steps from a 100-token prompt on slot 1 (attention's
    first block of 128 keys, then a second), the fused step
    from a CUDA graph against the static forward; fp32 to rounding (same greedy tokens), bf16 to
    bf16's (the fused norm does not round its output before the projection)."""
    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=3, vocab_size=4096)
    model = _random_model(cfg, dtype)
    ref_cache, cache = model.new_cache(2, 256), model.new_cache(2, 256)
    prompt = torch.randint(0, cfg.vocab_size, (100,), device="cuda")
    logits, _ = model(prompt, Batch.sequence(prompt, slot=1), ref_cache)
    model(prompt, Batch.sequence(prompt, slot=1), cache)
    fused, graphs = FusedLlama(model, pdl), GraphCache(torch.device("cuda"))
    slots = torch.ones(1, dtype=torch.long, device="cuda")
    tok = logits[-1].argmax().view(1)
    tol = 1e-4 if dtype == torch.float32 else 4e-2
    same = 0
    for pos in range(100, 140):
        positions = torch.full((1, 1), pos, dtype=torch.long, device="cuda")
        ctx = 128 if pos < 128 else 256
        ref, ref_aux = model(tok, Batch.padded(positions, slots, positions, ctx, capture=True), ref_cache)
        got, aux = graphs.run((), lambda tokens, positions, slots: fused.forward(
            tokens, Batch.padded(positions, slots, positions, 0, capture=True), cache),
            tokens=tok, positions=positions, slots=slots)  # one graph: any position
        assert got.shape == ref.shape == (1, cfg.vocab_size) and got.dtype == torch.float32
        assert aux is not None and ref_aux is not None and aux.shape == ref_aux.shape
        scale = ref.abs().max().item()
        assert (got - ref).abs().max().item() <= tol * scale
        assert (aux.float() - ref_aux.float()).abs().max().item() <= tol * ref_aux.float().abs().max().item()
        same += int(got.argmax() == ref.argmax())
        tok = ref[-1].argmax().view(1)  # both follow the reference's tokens
    assert len(graphs.graphs) == 1 and graphs.replays == 40
    assert same == 40 if dtype == torch.float32 else same >= 36
    kv_tol = 1e-5 if dtype == torch.float32 else 5e-2
    for ref_kv, kv in ((ref_cache.k, cache.k), (ref_cache.v, cache.v)):
        written = (ref_kv[:, 1, :140].float() - kv[:, 1, :140].float()).abs().max().item()
        assert written <= kv_tol * ref_kv[:, 1, :140].float().abs().max().item()
        assert not kv[:, 0].any()  # the other slot untouched


# a chain of 6 and trees of 16 (SGLang's topk 4 / 16 drafts shape) and of 40 (BLOCK_M 64)
VERIFY_SHAPES = {"chain6": [-1, 0, 1, 2, 3, 4],
                 "tree16": [-1, 0, 0, 0, 0, 1, 1, 2, 3, 4, 5, 5, 6, 7, 10, 11],
                 "tree40": [-1, *((i - 1) // 3 for i in range(1, 40))]}


@pytest.mark.gpu
@needs_gpus(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("shape", list(VERIFY_SHAPES))
def test_fused_verify_matches_the_static_path(dtype: torch.dtype, pdl: bool, shape: str) -> None:
    """SmolLM2's shape (3 layers): verifies of a chain or tree at committed lengths 100, 130, 160
    (1 to 3 blocks of 64 committed keys) on slot 1, the fused step from one CUDA graph against the
    static path's tree forward: logits, features, KV entries written."""
    parents = VERIFY_SHAPES[shape]
    t = len(parents)
    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=3, vocab_size=4096)
    model = _random_model(cfg, dtype)
    ref_cache, cache = model.new_cache(2, 256), model.new_cache(2, 256)
    prompt = torch.randint(0, cfg.vocab_size, (160,), device="cuda")
    model(prompt, Batch.sequence(prompt, slot=1), ref_cache)
    model(prompt, Batch.sequence(prompt, slot=1), cache)
    fused, graphs = FusedLlama(model, pdl), GraphCache(torch.device("cuda"))
    slots = torch.ones(1, dtype=torch.long, device="cuda")
    tol = 1e-4 if dtype == torch.float32 else 4e-2
    for start in (100, 130, 160):
        positions, rows, cols = tree_layout(start, parents)
        pos = torch.tensor([positions], device="cuda")
        entries = torch.arange(start, start + t, device="cuda").view(1, t)
        visible = torch.zeros(1, t, 256, dtype=torch.bool, device="cuda")
        visible[:, :, :start] = True
        visible[0, rows, cols] = True
        mask = visible[:, :, start : start + t].contiguous()  # [1, T, T]
        tokens = torch.randint(0, cfg.vocab_size, (t,), device="cuda")
        ref, ref_aux = model(tokens, Batch.padded(pos, slots, entries, 256, visible=visible, capture=True), ref_cache)
        got, aux = graphs.run((), lambda tokens, positions, slots, entries, mask: fused.forward(
            tokens, Batch.padded(positions, slots, entries, 0, mask, capture=True), cache), tokens=tokens,
            positions=pos, slots=slots, entries=entries, mask=mask)
        assert got.shape == ref.shape == (t, cfg.vocab_size) and got.dtype == torch.float32
        assert aux is not None and ref_aux is not None and aux.shape == ref_aux.shape
        assert (got - ref).abs().max().item() <= tol * ref.abs().max().item()
        assert (aux.float() - ref_aux.float()).abs().max().item() <= tol * ref_aux.float().abs().max().item()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert agree == 1.0 if dtype == torch.float32 else agree >= 0.8
        end = start + t
        for ref_kv, kv in ((ref_cache.k, cache.k), (ref_cache.v, cache.v)):
            written = (ref_kv[:, 1, :end].float() - kv[:, 1, :end].float()).abs().max().item()
            assert written <= tol * ref_kv[:, 1, :end].float().abs().max().item()
            assert not kv[:, 0].any()  # the other slot untouched
    assert len(graphs.graphs) == 1 and graphs.replays == 3


# each step: one row per sequence (None: the sequence sits the step out), as token counts or tree parents
BATCHED_STEPS: list[list[int | list[int] | None]] = [
    [1, 1, 1, 1],  # four decodes
    [1, None, 1, None],  # two of them
    [4, 4, 4, 4],  # four chains
    [VERIFY_SHAPES["tree16"], 3, 1, None],  # a tree, a chain and a decode, padded to 16 tokens each
    [VERIFY_SHAPES["chain6"], VERIFY_SHAPES["tree16"], 2, 5],
    [20, VERIFY_SHAPES["tree16"], 20, 3],  # 4 x 20 rows: two row tiles of the projections
]


@pytest.mark.quick
@pytest.mark.gpu
@needs_gpus(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_fused_steps_match_each_sequence_alone(dtype: torch.dtype) -> None:
    """SmolLM2's shape (3 layers): four sequences of 60, 100, 130 and 170 committed tokens on
    their own slots, stepped together through the fused step (decodes, chains, trees and mixes,
    each row padded to the longest, the batch to its bucket; up to 80 rows), against the same rows stepped one
    at a time through the fused step and together through the static path: logits, features,
    and every KV entry written."""
    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=3, vocab_size=4096)
    model = _random_model(cfg, dtype)
    together = ModelRunner(model, 4, 256, fused=FusedLlama(model, pdl=True))
    alone = ModelRunner(model, 4, 256, fused=FusedLlama(model, pdl=True))
    static = ModelRunner(model, 4, 256, padded_tokens=64)
    lengths = [60, 100, 130, 170]
    for n in lengths:
        prompt = torch.randint(0, cfg.vocab_size, (n,)).tolist()
        for r in (together, alone, static):
            r.run(Step([Row(r.allocate(), 0, prompt)]))
    tol = 1e-4 if dtype == torch.float32 else 4e-2
    for spec in BATCHED_STEPS:
        rows = []
        for slot, row in enumerate(spec):
            if row is None:
                continue
            parents = row if isinstance(row, list) else None
            t = len(parents) if parents else int(row)  # type: ignore[arg-type]
            rows.append(Row(slot, lengths[slot], torch.randint(0, cfg.vocab_size, (t,)).tolist(), parents))
        got = together.run(Step(rows, capture=True))
        each = [[x.clone() for x in alone.run(Step([row], capture=True))[0]] for row in rows]  # graph outputs
        ref = static.run(Step(rows, capture=True))
        for (logits, aux), (one, _), (want, want_aux) in zip(got, each, ref, strict=True):
            assert logits.shape == one.shape == want.shape and aux is not None and want_aux is not None
            scale = want.abs().max().item()
            assert (logits - want).abs().max().item() <= tol * scale
            assert (logits - one).abs().max().item() <= tol * scale
            assert (aux.float() - want_aux.float()).abs().max().item() <= tol * want_aux.float().abs().max().item()
            # the same greedy token wherever the static path's lead over its runner-up exceeds the
            # error bound (every row in fp32; in bf16 random weights leave near ties)
            top2 = want.float().topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * tol * scale if dtype != torch.float32 else top2[:, 0] == top2[:, 0]
            assert torch.equal(logits.argmax(-1)[clear], want.argmax(-1)[clear])
        for row in rows:  # the rows' tokens join the committed entries
            lengths[row.slot] += len(row.tokens)
    if together.graphs.enabled:
        assert {("fused", 4, 1, True), ("fused", 2, 1, True), ("fused", 4, 4, True), ("fused", 4, 16, True),
                ("fused", 4, 20, True)} <= {key[:4] for key in together.graphs.graphs}
    for slot, end in enumerate(lengths):
        for ref_kv, kv in ((static.cache.k, together.cache.k), (static.cache.v, together.cache.v),
                           (alone.cache.k, together.cache.k)):
            written = (ref_kv[:, slot, :end].float() - kv[:, slot, :end].float()).abs().max().item()
            assert written <= tol * ref_kv[:, slot, :end].float().abs().max().item()


@pytest.mark.gpu
@needs_gpus(1)
def test_fused_step_refuses_more_rows_than_it_takes() -> None:
    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=3, vocab_size=256)
    model = _random_model(cfg, torch.float32)
    fused = FusedLlama(model)
    cache = model.new_cache(8, 256)
    for b, t in ((1, fused.max_seq_rows + 1), (8, fused.max_rows // 8 + 1)):  # a sequence's rows, a step's
        tokens = torch.zeros(b, t, dtype=torch.long, device="cuda")
        batch = Batch.padded(tokens, torch.arange(b, device="cuda"), tokens, 0)
        with pytest.raises(ValueError, match=f"at most {fused.max_rows} tokens, {fused.max_seq_rows} a sequence"):
            fused.forward(tokens.view(b * t), batch, cache)


@pytest.mark.quick
@pytest.mark.gpu
@needs_gpus(1)
def test_engine_serves_decode_and_verify_through_the_fused_step(tiny_target: Path, tiny_head: Path) -> None:
    """fp32: target-only decoding with the fused step gives the static path's tokens, and
    speculation verified by it (chains and trees) equals target-only decoding, one sequence at a
    time and all four in one batch."""
    runs = {}
    for fused in ("off", "pdl"):
        e = LocalEngines(TargetConfig(model=str(tiny_target), device="cuda", dtype="float32", max_context=512,
                                      hidden_backend="cuda_ipc", fused_decode=fused),
                         DraftConfig(head=str(tiny_head), target=str(tiny_target), device="cuda", dtype="float32",
                                     max_context=512))
        try:
            runner = e.target.engine.runner
            if fused != "off":  # compiled at start, on a slot given back
                keys = {key[:4] for key in runner.graphs.graphs}
                assert {("fused", 1, 40, True), ("fused", 2, 1, True)} <= keys
            assert runner.free_slots == e.target.cfg.max_sequences

            def run(steps: int, topk: int = 1, e: LocalEngines = e) -> list[list[int]]:
                return [e.generate([GenerationRequest(p, 48, Sampling(), set(), steps, topk, 12 if topk > 1 else 0)]
                                   )[0].tokens for p in TINY_PROMPTS]

            runs[fused] = (run(0), run(4), run(3, topk=3))
            for steps, topk in ((0, 1), (4, 1), (3, 3)):  # every prompt in one batch: the solo runs' tokens
                together = e.generate([GenerationRequest(p, 48, Sampling(), set(), steps, topk, 12 if topk > 1 else 0)
                                       for p in TINY_PROMPTS])
                assert [r.tokens for r in together] == runs[fused][0]
            keys = list(e.target.engine.runner.graphs.graphs)
            fused_rows = sorted(k[2] for k in keys if k[0] == "fused")
            if fused == "off":
                assert not fused_rows
            else:  # decode, the chain of 4 drafts, trees of 12: each from a graph of its own
                assert fused_rows[0] == 1 and 5 in fused_rows and 12 in fused_rows
                assert any(k[0] == "fused" and k[1] == 4 for k in keys)  # four sequences a step
        finally:
            e.close()
    assert runs["pdl"][0] == runs["off"][0]
    assert runs["pdl"][1] == runs["pdl"][2] == runs["pdl"][0]
    assert runs["off"][1] == runs["off"][2] == runs["off"][0]


def test_auto_falls_back_to_the_padded_path_when_the_kernels_do_not_compile(
        tiny_target: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """--fused-decode auto on a machine where the fused step is chosen but its kernels fail to
    compile (Triton without a C compiler, say): the target starts on the padded path and says
    why; an explicit --fused-decode refuses to start instead."""
    import target_service.engine as engine_module
    from target_service.runtime import TargetRuntime

    class Uncompilable(PaddedAsFused):
        def __init__(self, model: LlamaModel, pdl: bool | None = None, few_rows: int | None = None) -> None:
            super().__init__(model)

        def forward(self, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
            raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(engine_module, "FusedLlama", Uncompilable)
    monkeypatch.setattr(engine_module, "fused_runs", lambda model: True)
    cfg = TargetConfig(model=str(tiny_target), max_context=64).validate()
    with caplog.at_level("WARNING", logger="specsplit.target"):
        rt = TargetRuntime(cfg, TensorParallel())
    try:
        assert rt.engine.runner.fused is None and "padded path serves" in caplog.text
        (res,), _ = rt.step([Prefill(1, [3, 14, 15], capture=False)], [])
        (res,), _ = rt.step([Verify(1, [], capture=False)], [])
        assert res.code == 0 and len(res.tokens) == 1
    finally:
        rt.close()
    cfg.fused_decode = "on"  # (validated for CUDA only: set after)
    with pytest.raises(RuntimeError, match="C compiler"):
        TargetRuntime(cfg, TensorParallel())
