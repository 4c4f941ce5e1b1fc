"""The target model: KV-cached decoding, EAGLE-3 feature capture, checkpoint conversion."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from specsplit.checkpoints.gguf_file import unpermute_rope
from specsplit.checkpoints.target_checkpoint import load_safetensors_dir, load_target_config
from specsplit.checkpoints.tiny import tiny_config
from specsplit.models.batch import Batch
from specsplit.models.config import LlamaConfig
from specsplit.models.llama import LlamaModel, random_llama_weights
from specsplit.models.parallel import TensorParallel, pack_for_cpu, shard_heads
from specsplit.tokenizer import TextCodec


def build(cfg: LlamaConfig, seed: int = 0, aux: list[int] | None = None) -> LlamaModel:
    m = LlamaModel(cfg, TensorParallel(), aux if aux is not None else cfg.default_aux_layer_ids())
    m.load_full_weights(random_llama_weights(cfg, seed=seed, std=0.2))
    return m.eval()


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3", "llama3-rope"])
def test_cached_decoding_matches_full_forward(variant: str) -> None:
    cfg = tiny_config()
    if variant == "qwen2":
        cfg.attention_bias = True
    elif variant == "qwen3":
        cfg.qk_norm = True
    elif variant == "llama3-rope":
        cfg.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}
    m = build(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    full, _ = m(tokens, Batch.sequence(tokens), m.new_cache(1, 64))
    cache = m.new_cache(1, 64)
    m(tokens[:12], Batch.sequence(tokens[:12]), cache)
    part, _ = m(tokens[12:15], Batch.sequence(tokens[12:15], 12), cache)  # a 3-token chunk, as a verify of 2 drafts
    last, _ = m(tokens[15:], Batch.sequence(tokens[15:], 15), cache)
    torch.testing.assert_close(torch.cat([part, last]), full[12:], rtol=1e-4, atol=1e-4)


def test_aux_capture_is_the_output_of_the_named_layers() -> None:
    cfg = tiny_config(layers=8)
    m = build(cfg)
    assert m.aux_layer_ids == [1, 3, 4]  # outputs of layers 1, N/2-1, N-4
    tokens = torch.arange(10)
    outputs = []
    hooks = [layer.register_forward_hook(lambda mod, inp, out: outputs.append(out)) for layer in m.layers]
    _, aux = m(tokens, Batch.sequence(tokens, capture=True), m.new_cache(1, 16))
    for h in hooks:
        h.remove()
    assert aux is not None and aux.shape == (10, 3 * cfg.hidden_size)
    expected = torch.cat([outputs[1], outputs[3], outputs[4]], dim=-1)
    assert torch.equal(aux, expected)


def test_aux_layer_ids_out_of_range_is_an_error() -> None:
    with pytest.raises(ValueError, match="outside"):
        LlamaModel(tiny_config(layers=4), TensorParallel(), [0, 1, 9])


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    n_head, head_dim, hidden = 3, 8, 5
    w = torch.randn(n_head * head_dim, hidden)
    # llama.cpp's convert_hf_to_gguf permutation (HF rotate_half -> interleaved)
    permuted = w.reshape(n_head, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rope(permuted, n_head), w)


def test_head_sharding_covers_every_head_once() -> None:
    for heads, kv, world in [(9, 3, 2), (8, 2, 4), (32, 8, 8), (8, 8, 3), (9, 3, 4), (9, 3, 8), (32, 8, 16),
                             (9, 3, 9), (32, 8, 32)]:
        shards = [shard_heads(heads, kv, TensorParallel(r, world)) for r in range(world)]
        assert sorted(h for s in shards for h in range(s.q_start, s.q_start + s.q_count)) == list(range(heads))
        group = heads // kv
        for s in shards:  # each rank's query heads read its KV heads, in equal groups
            assert s.q_count >= 1 and s.q_count % s.kv_count == 0
            assert {h // group for h in range(s.q_start, s.q_start + s.q_count)} == \
                set(range(s.kv_start, s.kv_start + s.kv_count))
    # fewer KV heads than ranks: KV heads replicated, q heads split evenly
    shards = [shard_heads(8, 2, TensorParallel(r, 4)) for r in range(4)]
    assert [s.kv_start for s in shards] == [0, 0, 1, 1] and all(s.q_count == 2 for s in shards)
    # SmolLM2's 3 KV groups on 8 ranks
    shards = [shard_heads(9, 3, TensorParallel(r, 8)) for r in range(8)]
    assert [s.q_count for s in shards] == [1, 1, 1, 1, 1, 1, 2, 1] and [s.kv_start for s in shards] == \
        [0, 0, 0, 1, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="would share a KV group"):
        shard_heads(9, 3, TensorParallel(0, 10))


def test_smollm2_conversion_answers_sensibly(smollm2_dir: Path) -> None:
    cfg = load_target_config(smollm2_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [2]
    m = LlamaModel(cfg, TensorParallel(), cfg.default_aux_layer_ids())
    m.load_full_weights(load_safetensors_dir(smollm2_dir))
    codec = TextCodec.from_checkpoint(smollm2_dir)
    ids = codec.encode(codec.render_chat("What is the capital of France?"))
    cache = m.new_cache(1, 128)
    logits, _ = m(torch.tensor(ids), Batch.sequence(torch.tensor(ids)), cache)
    out, n = [], len(ids)
    for _ in range(8):
        out.append(int(logits[-1].argmax()))
        logits, _ = m(torch.tensor(out[-1:]), Batch.sequence(torch.tensor(out[-1:]), n), cache)
        n += 1
    assert "Paris" in codec.decode(out)


def test_cpu_fp32_projections_packed_for_onednn_match_and_keep_each_rows_bits() -> None:
    """The runner packs an fp32 CPU model's projections once (models.parallel.pack_for_cpu): the
    same logits as the unpacked model to fp32 rounding, a row's bits whatever the row count (the
    property that keeps a verify's rows equal to decodes), and no packing for other dtypes or
    after weights are loaded again."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    torch.manual_seed(0)
    model = LlamaModel(dataclasses.replace(tiny_config(), num_layers=2), TensorParallel(), [0, 1])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    tokens = torch.randint(0, 512, (9,))
    cache = model.new_cache(1, 64)
    with torch.no_grad():
        want = model(tokens, Batch.sequence(tokens, slot=0), cache)[0]
        assert pack_for_cpu(model) == 4 * 2 + 1  # q|k|v, o, gate|up and down of each layer, the lm_head
        got = model(tokens, Batch.sequence(tokens, slot=0), cache)[0]
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
        h = torch.randn(9, 64)
        rows = [model.lm_head(h[:m])[0] for m in range(1, 10)]
        assert all(torch.equal(rows[0], r) for r in rows)
    model.lm_head.load_full(model.lm_head.weight.detach().clone())
    assert model.lm_head.packed is None  # loaded again: back to the unpacked product
    assert pack_for_cpu(model.to(torch.bfloat16)) == 0


@pytest.mark.parametrize(("name", "params"), [("llama-3.1-8b", 8.03e9), ("llama-3.1-70b", 70.55e9)])
def test_timing_shapes_have_their_models_parameter_counts_and_shard_over_eight_ranks(name: str, params: float) -> None:
    from specsplit.checkpoints.shapes import SHAPES

    cfg = SHAPES[name]
    with torch.device("meta"):
        whole = LlamaModel(cfg, TensorParallel(), cfg.default_aux_layer_ids())
        rank = LlamaModel(cfg, TensorParallel(7, 8), cfg.default_aux_layer_ids())
    assert abs(sum(p.numel() for p in whole.parameters()) / params - 1) < 0.005
    assert rank.kv_heads_local == 1 and rank.layers[0].self_attn.shard.q_count == cfg.num_heads // 8
