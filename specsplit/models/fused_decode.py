"""The fused one-token decode step of a Llama target: batch 1, one token, one GPU.

A decoder layer of the static path is ~20 kernels (norms, projections, rotary, KV writes,
attention, SiLU·mul, residual adds); at batch 1 an 8B step is then ~640 short kernels on top
of the weight streaming, ~1.6 ms a token on the H200 (docs/benchmarks.md, 3a). Here a layer
is five (specsplit.decode_kernels):

    qkv = W_qkv · rms_norm(h)                       norm_gemv
    o   = attention(rope(q), rope(k) → cache, v → cache)   rope_attention
    h   = h + W_o · o                               gemv_residual
    a   = silu(W_g · rms_norm(h)) * (W_u · rms_norm(h))    gate_up_silu
    h   = h + W_down · a                            gemv_residual

plus the embedding lookup and one norm_gemv for the final norm and lm_head. At batch 1
attention is latency-bound (~10 µs a layer at the 8B shape, a third of the gap to the bound,
until it read everything that does not depend on the previous kernel — position, slot,
rotary tables, the first block of earlier keys and values — before waiting for it).

Same signature and outputs as LlamaModel.static_forward for tokens [1, 1], so the target
engine captures it in a CUDA graph like any static step (`--fused-decode`); anything else
(more rows, trees, tensor parallelism, biases, q/k norms) keeps the static path.
"""

from __future__ import annotations

import torch

from specsplit.models.layers import KVCache
from specsplit.models.llama import LlamaModel


def fused_decode_unsupported(model: LlamaModel) -> str | None:
    """Why this model cannot use the fused decode step, or None."""
    cfg = model.cfg
    if model.tp.world_size != 1:
        return "the fused decode step runs on one GPU (tensor parallelism 1)"
    if cfg.attention_bias or cfg.qk_norm:
        return "the fused decode step supports neither attention biases nor q/k norms"
    if cfg.head_dim & (cfg.head_dim - 1) or cfg.head_dim > 256:
        return f"the fused decode step needs a power-of-two head_dim <= 256, not {cfg.head_dim}"
    if cfg.num_heads % cfg.num_kv_heads:
        return "the fused decode step needs num_heads divisible by num_kv_heads"
    return None


class FusedDecode:
    """Callable like LlamaModel.static_forward, for one sequence decoding one token."""

    def __init__(self, model: LlamaModel, pdl: bool = False) -> None:
        reason = fused_decode_unsupported(model)
        if reason:
            raise ValueError(reason)
        from specsplit import decode_kernels  # Triton: imported only when a fused step is made

        self.model, self.pdl, self.k = model, pdl, decode_kernels

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx: int,
                 cache: KVCache, capture: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions [1, 1], slots [1] (device tensors, so a graph replays any position)
        -> logits [1, 1, V] float32, aux [1, 1, 3H] or None. `ctx` is unused: attention reads
        entries [0, position] of the slot, whatever the bucket."""
        if tokens.shape != (1, 1) or positions.shape != (1, 1) or slots.shape != (1,):
            raise ValueError(f"the fused decode step takes one token of one sequence, got {tuple(tokens.shape)}")
        m, cfg, pdl, k = self.model, self.model.cfg, self.pdl, self.k
        eps = cfg.rms_norm_eps
        cos, sin = m.rotary.cos, m.rotary.sin  # [max_pos, D] float32, sin signed
        h = m.embed_tokens(tokens.view(1)).view(-1)  # [H]
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(m.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = k.norm_gemv(h, attn.qkv_proj.weight, layer.input_layernorm.weight, eps, pdl)  # [(Hq+2Hkv)*D]
            o = k.rope_attention(qkv, cos, sin, positions, slots, cache.k[i], cache.v[i], attn.shard.q_count,
                                 attn.shard.kv_count, pdl)  # [Hq*D]
            h = k.gemv_residual(o, attn.o_proj.weight, h, pdl)  # [H]
            a = k.gate_up_silu(h, mlp.gate_up_proj.weight, layer.post_attention_layernorm.weight, eps, pdl)  # [I]
            h = k.gemv_residual(a, mlp.down_proj.weight, h, pdl)
            if capture and i in m.aux_layer_ids:
                captured[i] = h
        logits = k.norm_gemv(h, m.lm_head.weight, m.norm.weight, eps, pdl, torch.float32)[: m.lm_head.vocab]  # [V]
        aux = torch.cat([captured[i] for i in m.aux_layer_ids]).view(1, 1, -1) if capture else None
        return logits.view(1, 1, -1), aux
