"""The fused steps of a Llama target on one GPU: one sequence's decode (one token), and B
sequences of T tokens each (B decodes, or verifies of chains and trees), up to
kernels.verify.MAX_ROWS tokens in all and kernels.verify.SEQ_ROWS a sequence.

A decoder layer of the padded path is ~20 kernels (norms, projections, rotary, KV writes,
attention, SiLU·mul, residual adds); at batch 1 an 8B step is then ~640 short kernels on top
of the weight streaming. Here a layer is five (kernels.decode for one token, kernels.projections
and kernels.verify for T):

    qkv = W_qkv · rms_norm(h)                       norm_gemv / norm_mm
    o   = attention(rope(q), rope(k) → cache, v → cache)   rope_attention / tree_attention
    h   = h + W_o · o                               gemv_residual / mm_residual
    a   = silu(W_g · rms_norm(h)) * (W_u · rms_norm(h))    gate_up_silu
    h   = h + W_down · a                            gemv_residual / mm_residual

plus the embedding lookup and one more norm + GEMM for the final norm and lm_head (for T tokens
the norms are split around the GEMMs: each residual add also writes the next norm's scaled
input, kernels.projections.Normed). At batch 1
attention is latency-bound: its kernel reads everything that does not depend on the previous
kernel (position, slot, rotary tables, the first block of committed keys and values) before
waiting for it, and splits a long context's keys over several programs a head (the workspace's
counters hand their partial softmaxes over; kernels.few splits a row's keys the same way).
A step of B×T tokens streams the same weights once for all its rows; its
attention runs a few programs per (KV head's query group, sequence), each over its own slot.

Under tensor parallelism each rank runs these kernels on its shard (its query and KV heads, its
columns of q|k|v and gate|up, its rows of o and down, its slice of the vocabulary) with one
all-reduce after the o and after the down projection, as the padded path does: rank 0's
projection adds the residual, the others' add zeros, so the sum is h + W·o. For T tokens the
next norm's scaled input is then written from the sum (kernels.projections.prenorm), and the
logits of every rank's vocabulary slice are gathered.

`FusedLlama.forward` takes what LlamaModel.forward takes, for a padded batch, so the runner
captures it in a CUDA graph like any step (`--fused-decode`); anything else (more rows,
biases, q/k norms) keeps the padded path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specsplit.models.batch import Batch
from specsplit.models.layers import KVCache
from specsplit.models.llama import LlamaModel

if TYPE_CHECKING:
    from specsplit.models.kernels.projections import Normed


def fused_attention_unsupported(step: str, head_dim: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why kernels.verify's attention cannot serve a fused `step` of these heads, or None."""
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        return f"the {step} step needs a power-of-two head_dim in 16..256, not {head_dim}"
    if num_heads % num_kv_heads:
        return f"the {step} step needs num_heads divisible by num_kv_heads"
    return None


def fused_decode_unsupported(model: LlamaModel) -> str | None:
    """Why this model cannot use the fused decode step, or None."""
    cfg = model.cfg
    if cfg.attention_bias or cfg.qk_norm:
        return "the fused decode step supports neither attention biases nor q/k norms"
    return fused_attention_unsupported("fused decode", cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)


def pdl_pays(hidden_size: int, rows: int, capability: tuple[int, int]) -> bool:
    """Whether a fused step of `rows` tokens should launch its kernels with programmatic
    dependent launch (Hopper and later): each kernel's programs start in the previous kernel's
    last wave and wait there. Measured on the H200 (bench.verify_step, docs/benchmarks.md): at
    SmolLM2's size (hidden 576) it makes the decode and verifies of 4 to 64 tokens 10-22%
    faster (32 tokens: 5% slower); at Llama-3.1-8B's (hidden 4096) the decode 5% faster, a 16-token
    verify 30% slower (its projection grids are many waves deep, and the next kernel's early
    programs hold multiprocessors while they wait). So: decodes always; steps of several rows
    up to a hidden size of 2048."""
    return capability[0] >= 9 and (rows == 1 or hidden_size <= 2048)


# Steps of up to this many rows run kernels.few unless told (models up to FEW_ROWS_HIDDEN wide):
# each row computes the decode's bits. Chosen per GPU model from bench.verify_step at SmolLM2's
# size with PDL and the GPU's pinned GEMV blocks (docs/benchmarks.md): on the H200 2 and 3 rows
# beat the tensor-core tiles and 4 lose; on the H100 4 rows win too.
FEW_ROWS_DEFAULT = 3
FEW_ROWS_BY_GPU = {"NVIDIA H100 80GB HBM3": 4}  # torch.cuda.get_device_name -> rows
FEW_ROWS_HIDDEN = 2048  # wider models (the 8B shape): not measured, the tensor-core tiles serve
FEW_ROWS_MAX = 8  # the most rows a step takes on kernels.few


def few_rows_default(hidden_size: int, rows: int | None = None, gpu: str = "") -> int:
    """Rows up to which a step of a model this wide runs kernels.few unless told where it is
    narrow enough (`rows`, else the GPU model's entry or FEW_ROWS_DEFAULT), else none."""
    rows = FEW_ROWS_BY_GPU.get(gpu, FEW_ROWS_DEFAULT) if rows is None else rows
    return rows if hidden_size <= FEW_ROWS_HIDDEN else 0


class FusedLlama:
    """LlamaModel's forward for a padded batch of B sequences of T tokens (B·T ≤ max_rows, T ≤
    max_seq_rows), as fused kernels. pdl: True or False for every step; None: per step, as pdl_pays says."""

    def __init__(self, model: LlamaModel, pdl: bool | None = False, few_rows: int | None = None) -> None:
        reason = fused_decode_unsupported(model)
        if reason:
            raise ValueError(reason)
        # Triton: imported only when a fused step is made
        from specsplit.models.kernels import decode, few, projections, verify

        self.model, self.pdl, self.k, self.few, self.proj, self.tree = model, pdl, decode, few, projections, verify
        dev = model.embed_tokens.weight.device
        self.capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else (0, 0)
        self.max_rows, self.max_seq_rows = verify.MAX_ROWS, verify.SEQ_ROWS
        self.ws = projections.Workspace(dev)  # split projections' partials, counters
        # steps of up to few_rows rows run kernels.few: each row as the decode computes it
        gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else ""
        self.few_rows = min(FEW_ROWS_MAX, few_rows_default(model.cfg.hidden_size, gpu=gpu) if few_rows is None
                            else few_rows)

    def takes(self, b: int, t: int) -> bool:
        """Whether a step of b sequences of t tokens fits."""
        return b * t <= self.max_rows and t <= self.max_seq_rows

    def pdl_for(self, rows: int) -> bool:
        return self.pdl if self.pdl is not None else pdl_pays(self.model.cfg.hidden_size, rows, self.capability)

    def forward(self, tokens: torch.Tensor, batch: Batch, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [B*T] of a padded batch (device tensors, so a graph replays any position) ->
        logits [B*T, V] float32, aux [B*T, 3H] or None, as LlamaModel.forward. Sequence b's
        tokens write entries batch.entries[b] (consecutive) of slot batch.slots[b] and see its
        committed entries plus the step's own that batch.tree_mask[b] [T, T] allows (default:
        causal)."""
        n = tokens.shape[0]
        if not batch.is_padded or batch.entries is None or batch.entries.numel() != n:
            raise ValueError(f"a fused step takes a padded batch, got {n} tokens")
        b, t = batch.entries.shape
        if not self.takes(b, t):
            raise ValueError(f"a fused step takes at most {self.max_rows} tokens, {self.max_seq_rows} a sequence, "
                             f"got {b} sequences of {t}")
        assert batch.slots is not None
        if n == 1:
            return self._decode(tokens, batch.positions, batch.slots, cache, batch.capture, self.pdl_for(1))
        mask = (torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril().expand(b, t, t).contiguous()
                if batch.tree_mask is None else batch.tree_mask)
        rows = self._few if n <= self.few_rows else self._rows
        return rows(tokens, batch.positions, batch.entries, batch.slots, mask, cache, batch.capture, self.pdl_for(n))

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache,
                capture: bool, pdl: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        m, cfg, k = self.model, self.model.cfg, self.k
        eps = cfg.rms_norm_eps
        cos, sin = m.rotary.cos, m.rotary.sin  # [max_pos, D] float32, sin signed
        h = m.embed_tokens(tokens).view(-1)  # [H]
        zero = torch.zeros_like(h) if m.tp.rank else None  # the residual of ranks past 0
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(m.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = k.norm_gemv(h, attn.qkv_proj.weight, layer.input_layernorm.weight, eps, pdl)  # [(Hq+2Hkv)*D]
            o = k.rope_attention(qkv, cos, sin, positions, slots, cache.k[i], cache.v[i], attn.shard.q_count,
                                 attn.shard.kv_count, pdl, self.ws.counters)  # [Hq*D]
            h = m.tp.all_reduce(k.gemv_residual(o, attn.o_proj.weight, h if zero is None else zero, pdl))  # [H]
            a = k.gate_up_silu(h, mlp.gate_up_proj.weight, layer.post_attention_layernorm.weight, eps, pdl)  # [I]
            h = m.tp.all_reduce(k.gemv_residual(a, mlp.down_proj.weight, h if zero is None else zero, pdl))
            if capture and i in m.aux_layer_ids:
                captured[i] = h
        logits = k.norm_gemv(h, m.lm_head.weight, m.norm.weight, eps, pdl, torch.float32)  # [V / ranks]
        logits = m.tp.all_gather_last(logits.view(1, -1))[:, : m.lm_head.vocab]  # [1, V]
        aux = torch.cat([captured[i] for i in m.aux_layer_ids]).view(1, -1) if capture else None
        return logits, aux

    def _few(self, tokens: torch.Tensor, positions: torch.Tensor, entries: torch.Tensor, slots: torch.Tensor,
             mask: torch.Tensor, cache: KVCache, capture: bool, pdl: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step of a few rows, each row computed as a decode at its position computes it (kernels.few)."""
        m, cfg, f = self.model, self.model.cfg, self.few
        eps = cfg.rms_norm_eps
        cos, sin = m.rotary.cos, m.rotary.sin
        h = m.embed_tokens(tokens)  # [B*T, H]
        zero = torch.zeros_like(h) if m.tp.rank else None  # the residual of ranks past 0
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(m.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = f.norm_gemv(h, attn.qkv_proj.weight, layer.input_layernorm.weight, eps, pdl)  # [B*T, (Hq+2Hkv)*D]
            o = f.row_attention(qkv, cos, sin, positions, entries, slots, mask, cache.k[i], cache.v[i],
                                attn.shard.q_count, attn.shard.kv_count, pdl, self.ws.counters)  # [B*T, Hq*D]
            h = m.tp.all_reduce(f.gemv_residual(o, attn.o_proj.weight, h if zero is None else zero, pdl))
            a = f.gate_up_silu(h, mlp.gate_up_proj.weight, layer.post_attention_layernorm.weight, eps, pdl)
            h = m.tp.all_reduce(f.gemv_residual(a, mlp.down_proj.weight, h if zero is None else zero, pdl))
            if capture and i in m.aux_layer_ids:
                captured[i] = h
        logits = f.norm_gemv(h, m.lm_head.weight, m.norm.weight, eps, pdl, torch.float32)  # [B*T, V / ranks]
        logits = m.tp.all_gather_last(logits)[:, : m.lm_head.vocab]
        aux = torch.cat([captured[i] for i in m.aux_layer_ids], -1) if capture else None
        return logits, aux

    def _rows(self, tokens: torch.Tensor, positions: torch.Tensor, entries: torch.Tensor, slots: torch.Tensor,
              mask: torch.Tensor, cache: KVCache, capture: bool, pdl: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        m, cfg, k, ws = self.model, self.model.cfg, self.proj, self.ws
        eps = cfg.rms_norm_eps
        cos, sin = m.rotary.cos, m.rotary.sin
        # every residual add also scales its output for the next RMS norm (kernels.projections.Normed)
        norms = [w for layer in m.layers for w in (layer.input_layernorm.weight,
                                                   layer.post_attention_layernorm.weight)] + [m.norm.weight]
        h, x = k.embed_prenorm(tokens, m.embed_tokens.weight, norms[0])  # [B*T, H]
        zero = torch.zeros_like(h) if m.tp.rank else None  # the residual of ranks past 0
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(m.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = k.norm_mm(x, attn.qkv_proj.weight, eps, pdl, ws=ws)  # [B*T, (Hq+2Hkv)*D]
            o = self.tree.tree_attention(qkv, cos, sin, positions, entries, slots, mask, cache.k[i], cache.v[i],
                                         attn.shard.q_count, attn.shard.kv_count, ws.counters, ws.sms,
                                         pdl)  # [B*T, Hq*D]
            h, x = self._residual(o, attn.o_proj.weight, h if zero is None else zero, norms[2 * i + 1], pdl)  # [B*T, H]
            a = k.gate_up_silu(x, mlp.gate_up_proj.weight, eps, pdl, ws)  # [B*T, I]
            h, x = self._residual(a, mlp.down_proj.weight, h if zero is None else zero, norms[2 * i + 2], pdl)
            if capture and i in m.aux_layer_ids:
                captured[i] = h
        logits = k.norm_mm(x, m.lm_head.weight, eps, pdl, torch.float32, ws)  # [B*T, V / ranks]
        logits = m.tp.all_gather_last(logits)[:, : m.lm_head.vocab]
        aux = torch.cat([captured[i] for i in m.aux_layer_ids], -1) if capture else None
        return logits, aux

    def _residual(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, next_norm: torch.Tensor,
                  pdl: bool) -> tuple[torch.Tensor, Normed]:
        """residual + x · weightᵀ [B*T, H] and its Normed for the next norm; under tensor
        parallelism the all-reduce of every rank's product (rank 0's residual the running h,
        the others' zeros), normed after."""
        tp, k = self.model.tp, self.proj
        if tp.world_size == 1:
            out, normed = k.mm_residual(x, weight, residual, pdl, self.ws, next_norm)
            assert normed is not None
            return out, normed
        out = tp.all_reduce(k.mm_residual(x, weight, residual, pdl, self.ws)[0])
        return out, k.prenorm(out, next_norm)
