"""The training module and the inference head agree: a checkpoint written by training and
loaded by the draft service computes the same logits, at step 0 (extend) and at every
unrolled TTT step (proposal steps). Plus the vocabulary maps and the batched target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_service.config import DraftConfig
from draft_service.runtime import build_head
from specsplit.checkpoints.eagle_head import load_head, save_head
from specsplit.checkpoints.target_checkpoint import load_safetensors_dir, load_target_config
from specsplit.models.batch import Batch
from specsplit.models.llama import LlamaModel, random_llama_weights
from specsplit.models.parallel import TensorParallel
from specsplit.training.distill import generate_batch
from specsplit.training.model import TrainableHead, head_config
from specsplit.training.target import BatchedTarget
from specsplit.training.vocab import build_vocab

STEPS = 5


def random_trained_head(tiny_target: Path, draft_size: int = 200, seed: int = 0) -> tuple[TrainableHead, object]:
    cfg_t = load_target_config(tiny_target)
    embed = load_safetensors_dir(tiny_target)["model.embed_tokens.weight"]
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 50, (cfg_t.vocab_size,), generator=g)
    vocab = build_vocab(counts, draft_size)
    head = TrainableHead(head_config(cfg_t, draft_size, [1, 2, 4], "test-head"), embed)
    with torch.no_grad():
        for p in head.parameters():  # every weight non-trivial, norms included
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.2) + (p.dim() == 1))
    return head, vocab


def test_trained_checkpoint_matches_inference_head_at_every_step(tiny_target: Path, tmp_path: Path) -> None:
    head, vocab = random_trained_head(tiny_target)
    save_head(tmp_path / "head", head.cfg, head.export(vocab, torch.float32))
    inf = build_head(DraftConfig(head=str(tmp_path / "head"), target=str(tiny_target)))
    assert torch.equal(inf.to_target_ids(torch.arange(vocab.size)), vocab.ids)

    g = torch.Generator().manual_seed(1)
    b, t = 2, 24
    x = torch.randint(0, 512, (b, t), generator=g)
    feats = torch.randn(b, t - 1, 3 * head.cfg.hidden_size, generator=g)  # features of positions 0..T-2
    inputs = torch.cat([x[:, 1:], torch.zeros(b, STEPS - 1, dtype=torch.long)], 1)
    with torch.no_grad():
        train_logits = list(head.unroll(feats, inputs, STEPS))  # STEPS x [B, N, Vd]

    n = t - 1
    for s in range(b):
        for i in [0, 3, 11, n - STEPS]:
            cache = inf.new_cache(1, 64)
            # extend: draft positions 0..i hold tokens x[1..i+1] with features 0..i
            toks = x[s, 1:i + 2]
            logits, pre = inf(toks, Batch.sequence(toks, hidden=feats[s, :i + 1]), cache)
            torch.testing.assert_close(logits[-1], train_logits[0][s, i], rtol=1e-4, atol=1e-4)
            hidden = pre[-1:]
            for k in range(1, STEPS):  # proposal k at draft position i + k, fed the data token x[i+1+k]
                toks = x[s, i + 1 + k:i + 2 + k]
                logits, hidden = inf(toks, Batch.sequence(toks, i + k, hidden=hidden), cache)
                torch.testing.assert_close(logits[0], train_logits[k][s, i], rtol=1e-4, atol=1e-4,
                                           msg=lambda m, k=k, i=i: f"step {k} position {i}: {m}")


def test_export_is_specforge_format(tiny_target: Path, tmp_path: Path) -> None:
    head, vocab = random_trained_head(tiny_target)
    save_head(tmp_path / "h", head.cfg, head.export(vocab))
    cfg, w = load_head(tmp_path / "h")
    assert cfg.draft_vocab_size == 200 and cfg.aux_layer_ids == [1, 2, 4]
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(200) + w["d2t"], torch.nonzero(w["t2d"]).flatten())
    assert w["lm_head.weight"].shape == (200, cfg.hidden_size) and w["fc.weight"].dtype == torch.bfloat16
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (q, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv, 2 * h), "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, q), "midlayer.mlp.gate_proj.weight": (i, h),
              "midlayer.mlp.up_proj.weight": (i, h), "midlayer.mlp.down_proj.weight": (h, i),
              "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
              "midlayer.post_attention_layernorm.weight": (h,), "norm.weight": (h,), "lm_head.weight": (200, h),
              "d2t": (200,), "t2d": (cfg.vocab_size,)}
    assert {k: tuple(v.shape) for k, v in w.items()} == shapes  # exactly the SpecForge keys: merged layers split
    merged = head.midlayer.self_attn.qkv_proj.weight.detach().to(torch.bfloat16)
    assert torch.equal(torch.cat([w[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"]), merged)


def test_vocab_by_frequency_and_maps() -> None:
    counts = torch.tensor([0, 5, 1, 9, 0, 5, 2, 0])
    v = build_vocab(counts, 4)
    assert v.ids.tolist() == [1, 3, 5, 6]  # 9, 5, 5, 2; ties by lower id
    assert v.d2t.tolist() == [1, 2, 3, 3] and v.t2d.tolist() == [False, True, False, True, False, True, True, False]
    assert v.coverage == pytest.approx(21 / 22)
    filled = build_vocab(counts, 7)  # more slots than seen tokens: unseen ids fill in, lowest first
    assert filled.ids.tolist() == [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_batched_target_matches_serving_model(tiny_target: Path, variant: str) -> None:
    """Features, logits and greedy generation of the training target equal the serving LlamaModel's."""
    cfg = load_target_config(tiny_target)
    weights = load_safetensors_dir(tiny_target)
    if variant != "llama":  # q/k/v biases (Qwen2) or per-head q/k RMSNorm (Qwen3)
        cfg.attention_bias, cfg.qk_norm = variant == "qwen2", variant == "qwen3"
        weights = random_llama_weights(cfg, seed=3, std=0.2)
    aux = cfg.default_aux_layer_ids()
    ref = LlamaModel(cfg, TensorParallel(), aux)
    ref.load_full_weights(weights)
    ref.eval()
    bt = BatchedTarget(cfg, weights, aux, "cpu", torch.float32)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 2, 41], list(range(100, 119))]
    samples = generate_batch(bt, prompts, 12, [])
    for p, s in zip(prompts, samples, strict=True):
        cache, ids = ref.new_cache(1, 64), list(p)
        logits, _ = ref(torch.tensor(ids), Batch.sequence(torch.tensor(ids)), cache)
        for _ in range(12):
            ids.append(int(logits[-1].argmax()))
            logits, _ = ref(torch.tensor(ids[-1:]), Batch.sequence(torch.tensor(ids[-1:]), len(ids) - 1), cache)
        assert s.ids.tolist() == ids and s.prompt_len == len(p)
        aux_b, normed = bt.features(s.ids[None])
        logits_ref, aux_ref = ref(s.ids, Batch.sequence(s.ids, capture=True), ref.new_cache(1, 64))
        torch.testing.assert_close(aux_b[0], aux_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(bt.logits(normed)[0], logits_ref, rtol=1e-4, atol=1e-4)
