"""The trainable EAGLE-3 head, unrolled for training-time test (TTT).

Module names are the SGLang / SpecForge checkpoint keys, so `export()` is the state dict
(plus d2t / t2d). The computation is the inference head's (specsplit.models.eagle3), made
batched over [B, N] and unrolled over K steps. Alignment, for training position i:

- step 0: token x[i+1], target features f[i], RoPE position i -> predicts the target's
  distribution at i+1. This is the draft's extend: draft position p pairs token p+1 with
  the target features of position p.
- step k >= 1: token x[i+1+k], hidden = the head's own pre-norm output of step k-1 at i,
  RoPE position i+k -> predicts the target's distribution at i+1+k. This is the k-th
  proposal after an extend that ended at draft position i.

Attention at step k, query i: the step-0 keys of positions j <= i (the extended prefix)
plus the keys of steps 1..k at position i (its own chain), exactly the draft KV cache at
that proposal step. (EAGLE-3's and SpecForge's reference training code additionally mask
step-0 keys i-k+1..i at step k; that is not what an inference engine attends to, ours and
SGLang's included, so this module does not; tests pin it against Eagle3Head.)
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.models.config import Eagle3Config, LlamaConfig
from specsplit.training.target import apply_rope, rms_norm, rope_tables
from specsplit.training.vocab import DraftVocab


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """q [B, Hq, N, D]; keys / values per step so far [B, Hkv, N, D] (step 0 first) -> [B, Hq, N, D].
    Step-0 keys are attended causally, the later steps' keys only on the diagonal."""
    b, hq, n, d = q.shape
    hkv = keys[0].shape[1]
    g = hq // hkv
    if len(keys) == 1:
        k0, v0 = keys[0].repeat_interleave(g, dim=1), values[0].repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
    scale = 1.0 / math.sqrt(d)
    qg = q.view(b, hkv, g, n, d)
    s0 = (qg @ keys[0][:, :, None].transpose(-1, -2)) * scale  # [B, Hkv, G, N, N]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s0 = s0.float().masked_fill(~causal, float("-inf"))
    diag = torch.stack([(qg * k[:, :, None]).sum(-1) for k in keys[1:]], dim=-1) * scale  # [B, Hkv, G, N, k]
    w = torch.softmax(torch.cat([s0, diag.float()], dim=-1), dim=-1).to(q.dtype)
    out = w[..., :n] @ values[0][:, :, None]  # [B, Hkv, G, N, D]
    later = torch.stack(values[1:], dim=3)[:, :, None]  # [B, Hkv, 1, N, k, D]
    out = out + (w[..., n:, None] * later).sum(-2)
    return out.reshape(b, hq, n, d)


class TrainableHead(nn.Module):
    def __init__(self, cfg: Eagle3Config, embed: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("embed", embed.detach(), persistent=False)  # the target's, frozen [V, H]
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_from_target(self, lm_head: torch.Tensor, final_norm: torch.Tensor, vocab: DraftVocab) -> None:
        """Start the output layer where the target's is: its lm_head rows of the draft vocabulary."""
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head[vocab.ids.to(lm_head.device)].float())
            self.norm.weight.copy_(final_norm.float())

    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor, pos0: int, keys: list[torch.Tensor],
              values: list[torch.Tensor]) -> torch.Tensor:
        """One unrolled step: hidden [B, N, H], tokens [B, N] at RoPE positions pos0.. -> pre-norm [B, N, H]."""
        m, a, c = self.midlayer, self.midlayer.self_attn, self.cfg
        b, n, _ = hidden.shape
        x = torch.cat([m.input_layernorm(self.embed[tokens]), m.hidden_norm(hidden)], dim=-1)  # [B, N, 2H]
        cos, sin = self.cos[pos0:pos0 + n], self.sin[pos0:pos0 + n]
        q = apply_rope(a.q_proj(x).view(b, n, -1, c.head_dim).transpose(1, 2), cos, sin)  # [B, Hq, N, D]
        keys.append(apply_rope(a.k_proj(x).view(b, n, -1, c.head_dim).transpose(1, 2), cos, sin))
        values.append(a.v_proj(x).view(b, n, -1, c.head_dim).transpose(1, 2))
        out = ttt_attention(q, keys, values).transpose(1, 2).reshape(b, n, -1)
        h = hidden + a.o_proj(out)
        return h + m.mlp(m.post_attention_layernorm(h))

    def unroll(self, feats: torch.Tensor, inputs: torch.Tensor, steps: int) -> Iterator[torch.Tensor]:
        """feats [B, N, 3H] (target features of positions 0..N-1); inputs [B, N + steps - 1] with
        inputs[:, j] = x[j + 1]. Yields the draft-vocab logits [B, N, Vd] of each step in turn."""
        n = feats.shape[1]
        if inputs.shape[1] < n + steps - 1:
            raise ValueError(f"inputs hold {inputs.shape[1]} tokens, {n + steps - 1} needed")
        hidden = self.fc(feats)  # [B, N, H]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for k in range(steps):
            hidden = self._step(hidden, inputs[:, k:k + n], k, keys, values)
            yield self.lm_head(self.norm(hidden))

    def export(self, vocab: DraftVocab, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """SGLang / SpecForge weights: fc, midlayer.*, norm, lm_head in `dtype`; d2t, t2d."""
        out = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        out["d2t"], out["t2d"] = vocab.d2t.clone(), vocab.t2d.clone()
        return out


def head_config(target: LlamaConfig, draft_vocab_size: int, aux_layer_ids: list[int], name: str) -> Eagle3Config:
    """A head shaped like one target layer (as the released EAGLE-3 heads are)."""
    return Eagle3Config(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                        num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, vocab_size=target.vocab_size,
                        draft_vocab_size=draft_vocab_size, head_dim=target.head_dim, rope_theta=target.rope_theta,
                        rope_scaling=target.rope_scaling, rms_norm_eps=target.rms_norm_eps,
                        max_position=target.max_position, aux_layer_ids=list(aux_layer_ids), name=name)
