"""A frozen, batched Llama-family target for training: prefill and decode over a static,
left-padded KV cache (generation), and one causal pass that returns the EAGLE-3 features
and the final normed state (training targets).

Built from the Hugging Face-named weights that the serving target loads (same RMSNorm,
RoPE and capture semantics as specsplit.models.llama, checked by the tests), but with
[batch, time] tensors and no per-sequence Python loop, so a few hundred sequences decode
together. Inference only: every method runs under torch.inference_mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specsplit.checkpoints.target_checkpoint import load_safetensors_dir, load_target_config, resolve_target_dir
from specsplit.models.config import LlamaConfig
from specsplit.models.layers import rope_inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The serving RMSNorm: normalise in fp32, cast back, then scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(head_dim: int, theta: float, scaling: dict | None, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_pos, head_dim] in fp32, rotate_half layout (as the serving Rotary)."""
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), rope_inv_freq(head_dim, theta, scaling))
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D]; cos, sin broadcastable to it (cast to x's dtype unless they have it)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


@dataclass
class Layer:
    ln1: torch.Tensor
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    bqkv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    ln2: torch.Tensor
    w_gate_up: torch.Tensor  # [2 I, H]
    w_down: torch.Tensor


@dataclass
class KV:
    k: torch.Tensor  # [layers, B, Hkv, S, D]
    v: torch.Tensor


class BatchedTarget:
    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], aux_layer_ids: list[int],
                 device: str | torch.device, dtype: torch.dtype) -> None:
        bad = [i for i in aux_layer_ids if not 0 <= i < cfg.num_layers]
        if len(aux_layer_ids) != 3 or bad:
            raise ValueError(f"need 3 aux layer ids in 0..{cfg.num_layers - 1}, got {aux_layer_ids}")
        self.cfg, self.aux_layer_ids, self.device, self.dtype = cfg, list(aux_layer_ids), torch.device(device), dtype

        def w(name: str) -> torch.Tensor:
            return weights[name].to(self.device, dtype)

        self.embed = w("model.embed_tokens.weight")  # [V, H]
        self.lm_head = w("lm_head.weight") if "lm_head.weight" in weights else self.embed
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            names = [f"{p}.self_attn.{n}_proj" for n in "qkv"]
            bias = torch.cat([w(f"{n}.bias") for n in names]) if cfg.attention_bias else None
            self.layers.append(Layer(
                ln1=w(f"{p}.input_layernorm.weight"), wqkv=torch.cat([w(f"{n}.weight") for n in names]), bqkv=bias,
                q_norm=w(f"{p}.self_attn.q_norm.weight") if cfg.qk_norm else None,
                k_norm=w(f"{p}.self_attn.k_norm.weight") if cfg.qk_norm else None,
                wo=w(f"{p}.self_attn.o_proj.weight"), ln2=w(f"{p}.post_attention_layernorm.weight"),
                w_gate_up=torch.cat([w(f"{p}.mlp.gate_proj.weight"), w(f"{p}.mlp.up_proj.weight")]),
                w_down=w(f"{p}.mlp.down_proj.weight")))
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)

    @classmethod
    def load(cls, spec: str, device: str | torch.device, dtype: torch.dtype,
             aux_layer_ids: list[int] | None = None) -> BatchedTarget:
        """spec: a target directory, a .gguf file or `smollm2` (see resolve_target_dir)."""
        model_dir = resolve_target_dir(spec)
        cfg = load_target_config(model_dir)
        return cls(cfg, load_safetensors_dir(model_dir), aux_layer_ids or cfg.default_aux_layer_ids(), device, dtype)

    # -- one decoder layer; `attend(layer, q, k, v)` owns the attention pattern and the cache

    def _layer(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:  # noqa: ANN001
        c, L = self.cfg, self.layers[i]
        b, t, _ = h.shape
        qkv = F.linear(rms_norm(h, L.ln1, c.rms_norm_eps), L.wqkv, L.bqkv)  # [B, T, (Hq + 2 Hkv) D]
        q, k, v = qkv.view(b, t, -1, c.head_dim).transpose(1, 2).split(
            [c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=1)  # [B, heads, T, D]
        if L.q_norm is not None and L.k_norm is not None:
            q, k = rms_norm(q, L.q_norm, c.rms_norm_eps), rms_norm(k, L.k_norm, c.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(i, q, k, v.contiguous())  # [B, Hq, T, D]
        h = h + F.linear(out.transpose(1, 2).reshape(b, t, -1), L.wo)
        gate, up = F.linear(rms_norm(h, L.ln2, c.rms_norm_eps), L.w_gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, L.w_down)

    def _groups(self) -> int:
        return self.cfg.num_heads // self.cfg.num_kv_heads

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return F.linear(normed, self.lm_head)  # [..., V] in the model dtype

    # -- training: one causal pass over right-padded sequences

    @torch.inference_mode()
    def features(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> aux [B, T, 3H] (outputs of the capture layers), normed final state [B, T, H].
        Right padding is harmless: position t only sees positions <= t."""
        t = tokens.shape[1]
        cos, sin = self.cos[:t].to(self.dtype), self.sin[:t].to(self.dtype)  # cast once, not per layer
        g = self._groups()

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        h = self.embed[tokens]
        captured = {}
        for i in range(self.cfg.num_layers):
            h = self._layer(i, h, cos, sin, attend)
            if i in self.aux_layer_ids:
                captured[i] = h
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)
        return aux, rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    # -- generation: static cache, left padding, every sequence writes the same column

    def new_cache(self, batch: int, max_len: int) -> KV:
        shape = (self.cfg.num_layers, batch, self.cfg.num_kv_heads, max_len, self.cfg.head_dim)
        return KV(torch.zeros(shape, dtype=self.dtype, device=self.device),
                  torch.zeros(shape, dtype=self.dtype, device=self.device))

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, pad: torch.Tensor, cache: KV) -> torch.Tensor:
        """tokens [B, P] left-padded by pad [B] -> normed state of the last column [B, H];
        fills cache columns 0..P-1."""
        b, p = tokens.shape
        col = torch.arange(p, device=self.device)
        pos = (col[None, :] - pad[:, None]).clamp(min=0)  # [B, P]
        cos, sin = self.cos[pos][:, None].to(self.dtype), self.sin[pos][:, None].to(self.dtype)  # [B, 1, P, D]
        causal = col[None, :] <= col[:, None]  # [P, P]
        valid = col[None, :] >= pad[:, None]  # [B, P] real keys
        mask = (causal & valid[:, None, :]) | torch.eye(p, dtype=torch.bool, device=self.device)  # pads see themselves
        mask = mask[:, None]  # [B, 1, P, P]
        g = self._groups()

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.k[i, :, :, :p], cache.v[i, :, :, :p] = k, v
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        h = self.embed[tokens]
        for i in range(self.cfg.num_layers):
            h = self._layer(i, h, cos, sin, attend)
        return rms_norm(h[:, -1], self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, column: int, key_mask: torch.Tensor,
               cache: KV) -> torch.Tensor:
        """One token per sequence: tokens [B] at positions [B], written to cache column `column`;
        key_mask [B, S] says which cache columns each sequence attends to -> normed state [B, H]."""
        b = tokens.shape[0]
        g, hkv, d = self._groups(), self.cfg.num_kv_heads, self.cfg.head_dim
        cos = self.cos[positions][:, None, None].to(self.dtype)  # [B, 1, 1, D]
        sin = self.sin[positions][:, None, None].to(self.dtype)
        mask = key_mask[:, None, None, :]  # [B, 1, 1, S]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.k[i, :, :, column], cache.v[i, :, :, column] = k[:, :, 0], v[:, :, 0]
            # the G query heads of one KV head become G query rows: no KV repeat over the cache
            qg = q.view(b, hkv, g, d)
            out = F.scaled_dot_product_attention(qg, cache.k[i], cache.v[i], attn_mask=mask)  # [B, Hkv, G, D]
            return out.reshape(b, hkv * g, 1, d)

        h = self.embed[tokens][:, None]  # [B, 1, H]
        for i in range(self.cfg.num_layers):
            h = self._layer(i, h, cos, sin, attend)
        return rms_norm(h[:, 0], self.norm, self.cfg.rms_norm_eps)
