"""The fused one-token decode step (specsplit.models.fused_decode): its logits, features and
KV entries against the static path's, eagerly and from CUDA graphs, with and without
programmatic dependent launch; the target engine serving it; and the configurations it refuses."""

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
from specsplit.models.cuda_graphs import GraphCache
from specsplit.models.fused_decode import FusedDecode, fused_decode_unsupported
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import TensorParallel
from specsplit.ops import Sampling
from target_service.config import TargetConfig
from tests.test_gpu_services import TINY_PROMPTS, needs_gpus


def test_config_refuses_fused_decode_off_cuda_or_with_tensor_parallelism() -> None:
    with pytest.raises(ValueError, match="CUDA device and tp_size 1"):
        TargetConfig(fused_decode="on").validate()
    with pytest.raises(ValueError, match="CUDA device and tp_size 1"):
        TargetConfig(device="cuda", tp_size=2, fused_decode="pdl").validate()
    with pytest.raises(ValueError, match="fused_decode 'yes' not in"):
        TargetConfig(device="cuda", fused_decode="yes").validate()
    assert TargetConfig(device="cuda:1", fused_decode="pdl").validate().fused_decode == "pdl"


def test_models_the_fused_step_cannot_run_are_refused_with_the_reason() -> None:
    def model(tp: TensorParallel = TensorParallel(), **changes: object) -> LlamaModel:  # noqa: B008
        return LlamaModel(dataclasses.replace(tiny_config(layers=1), **changes), tp, [0])

    assert fused_decode_unsupported(model()) is None
    assert "tensor parallelism" in str(fused_decode_unsupported(model(TensorParallel(0, 2))))
    assert "biases" in str(fused_decode_unsupported(model(attention_bias=True)))
    assert "q/k norms" in str(fused_decode_unsupported(model(qk_norm=True)))
    assert "power-of-two head_dim" in str(fused_decode_unsupported(model(head_dim=24)))
    with pytest.raises(ValueError, match="biases"):
        FusedDecode(model(attention_bias=True))


def _random_model(cfg: object, dtype: torch.dtype) -> LlamaModel:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaModel(cfg, TensorParallel(), [0, 1, 2]).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model.to(dtype)


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
    logits, _ = model(prompt, 0, ref_cache, 1)
    model(prompt, 0, cache, 1)
    fused, graphs = FusedDecode(model, pdl), GraphCache(torch.device("cuda"))
    slots = torch.ones(1, dtype=torch.long, device="cuda")
    tok = logits[-1].argmax().view(1, 1)
    tol = 1e-4 if dtype == torch.float32 else 4e-2
    same = 0
    for pos in range(100, 140):
        positions = torch.full((1, 1), pos, dtype=torch.long, device="cuda")
        ref, ref_aux = model.forward_static(tok, positions, slots, 128 if pos < 128 else 256, ref_cache, True)
        got, aux = graphs.run((), lambda tokens, positions, slots: fused(tokens, positions, slots, 256, cache, True),
                              tokens=tok, positions=positions, slots=slots)  # one graph: any position
        assert got.shape == ref.shape == (1, 1, cfg.vocab_size) and got.dtype == torch.float32
        assert aux is not None and ref_aux is not None and aux.shape == ref_aux.shape
        scale = ref.abs().max().item()
        assert (got - ref).abs().max().item() <= tol * scale
        assert (aux.float() - ref_aux.float()).abs().max().item() <= tol * ref_aux.float().abs().max().item()
        same += int(got.argmax() == ref.argmax())
        tok = ref[0, -1].argmax().view(1, 1)  # both follow the reference's tokens
    assert len(graphs.graphs) == 1 and graphs.replays == 40
    assert same == 40 if dtype == torch.float32 else same >= 36
    kv_tol = 1e-5 if dtype == torch.float32 else 5e-2
    for ref_kv, kv in ((ref_cache.k, cache.k), (ref_cache.v, cache.v)):
        written = (ref_kv[:, 1, :140].float() - kv[:, 1, :140].float()).abs().max().item()
        assert written <= kv_tol * ref_kv[:, 1, :140].float().abs().max().item()
        assert not kv[:, 0].any()  # the other slot untouched


@pytest.mark.gpu
@needs_gpus(1)
def test_engine_serves_decode_through_the_fused_step(tiny_target: Path, tiny_head: Path) -> None:
    """fp32: target-only decoding with the fused step gives the static path's tokens, and
    speculation (verifies on the static path) still equals it."""
    runs = {}
    for fused in ("off", "pdl"):
        e = LocalEngines(TargetConfig(model=str(tiny_target), device="cuda", dtype="float32", max_context=512,
                                      hidden_backend="cuda_ipc", fused_decode=fused),
                         DraftConfig(head=str(tiny_head), target=str(tiny_target), device="cuda", dtype="float32",
                                     max_context=512))
        try:
            def run(steps: int, e: LocalEngines = e) -> list[list[int]]:
                # one sequence at a time: the fused step serves batches of one
                return [e.generate([GenerationRequest(p, 48, Sampling(), set(), steps)])[0].tokens
                        for p in TINY_PROMPTS]

            runs[fused] = (run(0), run(4))
            keys = list(e.target.engine.graphs.graphs)
            assert any(k[-1] for k in keys) == (fused != "off")  # a fused graph was captured and replayed
        finally:
            e.close()
    assert runs["pdl"][0] == runs["off"][0]
    assert runs["pdl"][1] == runs["pdl"][0] == runs["off"][1]
