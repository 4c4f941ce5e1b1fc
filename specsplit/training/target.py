"""A frozen, batched Llama-family target for training: prefill and decode over a static,
left-padded KV cache (generation), and one causal pass that returns the EAGLE-3 features
and the final normed state (training targets).

The serving LlamaModel (specsplit.models.llama) holds the weights and computes every layer
but the attention: its norms, merged q/k/v projection, rotary, o_proj and MLP run over the
[batch, time] tokens flattened, and this module's attention patterns (causal, left-padded,
static cache) replace its per-sequence KV-cache attention, so a few hundred sequences decode
together with no per-sequence Python loop. Inference only: every method runs under
torch.inference_mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specsplit.checkpoints.target_checkpoint import load_safetensors_dir, load_target_config, resolve_target_dir
from specsplit.models.config import LlamaConfig
from specsplit.models.layers import RopeTables
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import TensorParallel

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (layer, q, k, v) -> out


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
        cuda = [self.device] if self.device.type == "cuda" else []
        # built as the target service builds it; its random init, overwritten next, leaves the caller's RNG as it was
        with torch.random.fork_rng(cuda), torch.device(self.device):
            self.model = LlamaModel(cfg, TensorParallel(), self.aux_layer_ids).to(dtype)
        self.model.load_full_weights(weights)
        self.model.eval()

    @property
    def embed(self) -> torch.Tensor:
        return self.model.embed_tokens.weight  # [V, H]

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight  # [V, H]

    @property
    def norm(self) -> torch.Tensor:
        return self.model.norm.weight  # [H]

    @classmethod
    def load(cls, spec: str, device: str | torch.device, dtype: torch.dtype,
             aux_layer_ids: list[int] | None = None) -> BatchedTarget:
        """spec: a target directory, a .gguf file or `smollm2` (see resolve_target_dir)."""
        model_dir = resolve_target_dir(spec)
        cfg = load_target_config(model_dir)
        return cls(cfg, load_safetensors_dir(model_dir), aux_layer_ids or cfg.default_aux_layer_ids(), device, dtype)

    # -- one decoder layer over [B, T] tokens flattened; `attend` owns the attention pattern and the cache

    def _rope(self, positions: torch.Tensor) -> RopeTables:
        """positions [N] -> cos, signed sin [N, 1, D] in the model dtype, looked up once per forward."""
        return self.model.rotary.tables(positions, self.dtype)

    def _layer(self, i: int, h: torch.Tensor, rope: RopeTables, b: int, attend: Attend) -> torch.Tensor:
        """h [B * T, H] -> [B * T, H]; attend(i, q, k, v) on [B, heads, T, D] -> [B, Hq, T, D]."""
        layer = self.model.layers[i]
        a = layer.self_attn
        q, k, v = (y.view(b, -1, y.shape[1], a.head_dim).transpose(1, 2)
                   for y in a.project(layer.input_layernorm(h), rope))  # [B, heads, T, D]
        out = attend(i, q, k, v.contiguous())
        h = h + a.o_proj(out.transpose(1, 2).reshape(h.shape[0], -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _groups(self) -> int:
        return self.cfg.num_heads // self.cfg.num_kv_heads

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(normed)  # [..., V] in the model dtype

    # -- training: one causal pass over right-padded sequences

    @torch.inference_mode()
    def features(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> aux [B, T, 3H] (outputs of the capture layers), normed final state [B, T, H].
        Right padding is harmless: position t only sees positions <= t."""
        b, t = tokens.shape
        rope = self._rope(torch.arange(t, device=self.device).repeat(b))
        g = self._groups()

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        h = self.model.embed_tokens(tokens.flatten())  # [B * T, H]
        captured = {}
        for i in range(self.cfg.num_layers):
            h = self._layer(i, h, rope, b, attend)
            if i in self.aux_layer_ids:
                captured[i] = h
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)
        return aux.view(b, t, -1), self.model.norm(h).view(b, t, -1)

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
        rope = self._rope(pos.flatten())
        causal = col[None, :] <= col[:, None]  # [P, P]
        valid = col[None, :] >= pad[:, None]  # [B, P] real keys
        mask = (causal & valid[:, None, :]) | torch.eye(p, dtype=torch.bool, device=self.device)  # pads see themselves
        mask = mask[:, None]  # [B, 1, P, P]
        g = self._groups()

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.k[i, :, :, :p], cache.v[i, :, :, :p] = k, v
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        h = self.model.embed_tokens(tokens.flatten())  # [B * P, H]
        for i in range(self.cfg.num_layers):
            h = self._layer(i, h, rope, b, attend)
        return self.model.norm(h.view(b, p, -1)[:, -1])

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, column: int, key_mask: torch.Tensor,
               cache: KV) -> torch.Tensor:
        """One token per sequence: tokens [B] at positions [B], written to cache column `column`;
        key_mask [B, S] says which cache columns each sequence attends to -> normed state [B, H]."""
        b = tokens.shape[0]
        g, hkv, d = self._groups(), self.cfg.num_kv_heads, self.cfg.head_dim
        rope = self._rope(positions)
        mask = key_mask[:, None, None, :]  # [B, 1, 1, S]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.k[i, :, :, column], cache.v[i, :, :, column] = k[:, :, 0], v[:, :, 0]
            # the G query heads of one KV head become G query rows: no KV repeat over the cache
            qg = q.view(b, hkv, g, d)
            out = F.scaled_dot_product_attention(qg, cache.k[i], cache.v[i], attn_mask=mask)  # [B, Hkv, G, D]
            return out.reshape(b, hkv * g, 1, d)

        h = self.model.embed_tokens(tokens)  # [B, H]: one token each
        for i in range(self.cfg.num_layers):
            h = self._layer(i, h, rope, b, attend)
        return self.model.norm(h)
