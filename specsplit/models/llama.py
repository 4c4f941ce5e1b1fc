"""Llama-family target model, tensor-parallel, with EAGLE-3 feature capture."""

from __future__ import annotations

import torch
from torch import nn

from specsplit.models.batch import Batch
from specsplit.models.config import LlamaConfig
from specsplit.models.layers import MLP, Attention, KVCache, RMSNorm, RopeTables, Rotary
from specsplit.models.parallel import ParallelLMHead, TensorParallel, shard_heads


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel) -> None:
        super().__init__()
        shard = shard_heads(cfg.num_heads, cfg.num_kv_heads, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.head_dim, shard, tp, bias=cfg.attention_bias,
                                   qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp)

    def forward(self, h: torch.Tensor, rope: RopeTables, cache: KVCache, layer: int, batch: Batch) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, cache, layer, batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """The target. One rank's shard of it when tp.world_size > 1."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel, aux_layer_ids: list[int]) -> None:
        super().__init__()
        bad = [i for i in aux_layer_ids if not 0 <= i < cfg.num_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} outside 0..{cfg.num_layers - 1}")
        self.cfg, self.tp, self.aux_layer_ids = cfg, tp, list(aux_layer_ids)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # replicated on every rank
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
        self.kv_heads_local = self.layers[0].self_attn.shard.kv_count
        self.requires_grad_(False)  # served, never trained here

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.cfg.num_layers, slots, max_len, self.kv_heads_local, self.cfg.head_dim, p.dtype, p.device)

    def forward(self, tokens: torch.Tensor, batch: Batch, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [N] -> logits [N, V] float32 ([R, V] for the R tokens batch.logits_at names), and
        with batch.capture the outputs of the capture layers [N, 3H] (else None)."""
        h = self.embed_tokens(tokens)  # [N, H]
        rope = self.rotary.tables(batch.positions, h.dtype)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, cache, i, batch)
            if batch.capture and i in self.aux_layer_ids:
                captured[i] = h
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], -1) if batch.capture else None
        if batch.logits_at is not None:
            h = h[batch.logits_at]
        return self.lm_head(self.norm(h)).float(), aux

    def load_full_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named, unsharded weights; each rank keeps its slice."""
        self.embed_tokens.weight.data.copy_(weights["model.embed_tokens.weight"])
        self.norm.weight.data.copy_(weights["model.norm.weight"])
        lm = weights.get("lm_head.weight")
        self.lm_head.load_full(weights["model.embed_tokens.weight"] if lm is None else lm)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            layer.input_layernorm.weight.data.copy_(weights[f"{p}.input_layernorm.weight"])
            layer.post_attention_layernorm.weight.data.copy_(weights[f"{p}.post_attention_layernorm.weight"])
            layer.self_attn.load(weights, f"{p}.self_attn")
            layer.mlp.load(weights, f"{p}.mlp")


def random_llama_weights(cfg: LlamaConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Hugging Face-named random weights (timing models and tiny test models)."""
    g = torch.Generator().manual_seed(seed)
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": rnd(cfg.vocab_size, h), "model.norm.weight": torch.ones(h)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = rnd(cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}"
        w[f"{p}.input_layernorm.weight"] = torch.ones(h)
        w[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
        w[f"{p}.self_attn.q_proj.weight"] = rnd(cfg.num_heads * d, h)
        w[f"{p}.self_attn.k_proj.weight"] = rnd(cfg.num_kv_heads * d, h)
        w[f"{p}.self_attn.v_proj.weight"] = rnd(cfg.num_kv_heads * d, h)
        w[f"{p}.self_attn.o_proj.weight"] = rnd(h, cfg.num_heads * d)
        if cfg.attention_bias:
            for name, rows in (("q_proj", cfg.num_heads * d), ("k_proj", cfg.num_kv_heads * d),
                               ("v_proj", cfg.num_kv_heads * d)):
                w[f"{p}.self_attn.{name}.bias"] = rnd(rows)
        if cfg.qk_norm:
            w[f"{p}.self_attn.q_norm.weight"] = torch.ones(d)
            w[f"{p}.self_attn.k_norm.weight"] = torch.ones(d)
        w[f"{p}.mlp.gate_proj.weight"] = rnd(i, h)
        w[f"{p}.mlp.up_proj.weight"] = rnd(i, h)
        w[f"{p}.mlp.down_proj.weight"] = rnd(h, i)
    return w
