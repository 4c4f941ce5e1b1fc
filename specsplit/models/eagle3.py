"""EAGLE-3 draft head: fc(3H -> H), one decoder layer with a 2H-wide attention input,
a final norm whose pre-norm sum feeds the next step, and a reduced-vocabulary lm_head."""

from __future__ import annotations

import torch
from torch import nn

from specsplit.models.batch import Batch
from specsplit.models.config import Eagle3Config
from specsplit.models.layers import MLP, Attention, KVCache, RMSNorm, RopeTables, Rotary
from specsplit.models.parallel import ParallelLMHead, TensorParallel, shard_heads


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config, tp: TensorParallel) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)  # on the token embeddings
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)  # on the hidden input
        shard = shard_heads(cfg.num_heads, cfg.num_kv_heads, tp)
        self.self_attn = Attention(2 * h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, shard, tp)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size, tp)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: RopeTables,
                cache: KVCache, batch: Batch) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [N, 2H]
        h = hidden + self.self_attn(x, rope, cache, 0, batch)
        return h + self.mlp(self.post_attention_layernorm(h))  # pre-norm sum [T, H]


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # borrowed from the target
        self.midlayer = Eagle3MidLayer(cfg, tp)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.draft_vocab_size, tp)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long), persistent=False)
        self.kv_heads_local = self.midlayer.self_attn.shard.kv_count
        self.requires_grad_(False)  # served, never trained here

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        p = self.fc.weight
        return KVCache(1, slots, max_len, self.kv_heads_local, self.cfg.head_dim, p.dtype, p.device)

    def forward(self, tokens: torch.Tensor, batch: Batch, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [N] and batch.hidden: target features [N, 3H] or the head's own previous
        pre-norm states [N, H] -> draft-vocab logits [N, Vd] float32 ([R, Vd] for the R tokens
        batch.logits_at names), pre-norm states [N, H] (the next step's hidden input)."""
        hidden = batch.hidden
        assert hidden is not None, "the head reads batch.hidden"
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = self.fc(hidden.to(self.fc.weight.dtype))
        rope = self.rotary.tables(batch.positions, hidden.dtype)
        prenorm = self.midlayer(self.embed_tokens(tokens), hidden, rope, cache, batch)
        last = prenorm if batch.logits_at is None else prenorm[batch.logits_at]
        return self.lm_head(self.norm(last)).float(), prenorm

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def load_weights(self, weights: dict[str, torch.Tensor], target_embedding: torch.Tensor) -> None:
        """SGLang / SpecForge key names; the token embedding is always the target's."""
        self.fc.weight.data.copy_(weights["fc.weight"])
        if self.fc.bias is not None:
            self.fc.bias.data.copy_(weights["fc.bias"])
        self.embed_tokens.weight.data.copy_(target_embedding)  # the target's, as SGLang does, even if shipped
        m = self.midlayer
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            getattr(m, name).weight.data.copy_(weights[f"midlayer.{name}.weight"])
        m.self_attn.load(weights, "midlayer.self_attn")
        m.mlp.load(weights, "midlayer.mlp")
        self.norm.weight.data.copy_(weights["norm.weight"])
        lm = weights.get("lm_head.weight")
        if lm is None:
            if not self.cfg.tie_word_embeddings:
                raise KeyError("lm_head.weight missing and the config does not tie embeddings")
            lm = self.embed_tokens.weight.data
        self.lm_head.load_full(lm)
        d2t = weights.get("d2t")
        if d2t is None:
            if self.cfg.draft_vocab_size != self.cfg.vocab_size:
                raise KeyError("d2t missing for a reduced draft vocabulary")
        else:
            self.d2t.copy_(d2t.long())
        ids = self.to_target_ids(torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device))
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError("d2t maps draft ids outside the target vocabulary")
