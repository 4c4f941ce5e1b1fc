"""The EAGLE-3 head's step on one GPU as fused kernels: what `Eagle3Head.forward` computes for a
padded batch of B sequences of T tokens (B·T ≤ kernels.verify.MAX_ROWS, T ≤ SEQ_ROWS): an extend (the target's
features through fc, causal), or one level of a draft tree (the head's own pre-norm states, each
node seeing the committed entries, its ancestors' and its own).

    x   = [rms_norm(E[tokens]), rms_norm(hidden)]           head_input
    qkv = W_qkv · x                                          one GEMM (torch)
    o   = attention(rope(q), rope(k) → cache, v → cache)     tree_attention (visible rows or causal)
    h   = hidden + W_o · o                                   mm_residual (+ the next norm's input)
    a   = silu(W_g · rms_norm(h)) * (W_u · rms_norm(h))      gate_up_silu
    h'  = h + W_down · a                                     mm_residual (the pre-norm states)
    logits = W_lm · rms_norm(h')                             norm_mm, float32

Steps of up to `few_rows` rows (a chain's, a tree level's) run the projections after attention
as the decode's GEMVs over every row (kernels.few).
The unfused head runs ~60 kernels a step; this runs seven (eight for an extend: fc).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from specsplit.models.batch import Batch
from specsplit.models.eagle3 import Eagle3Head
from specsplit.models.fused import FEW_ROWS_MAX, few_rows_default, fused_attention_unsupported, pdl_pays
from specsplit.models.layers import KVCache

log = logging.getLogger("specsplit.draft")

# Steps of up to this many rows run kernels.few unless told (heads up to fused.FEW_ROWS_HIDDEN wide).
# Chosen from bench.head_step at SmolLM2's size (docs/benchmarks.md: 1 row beats the tensor-core
# tiles on the H100 and the H200, 2 rows on the H100 and ties on the H200, 3 and 4 lose).
HEAD_FEW_ROWS = 2


def fused_head_unsupported(head: Eagle3Head) -> str | None:
    """Why this head cannot run the fused step, or None."""
    cfg = head.cfg
    attn = head.midlayer.self_attn
    if attn.shard.q_count != cfg.num_heads:
        return "the fused head step runs on one GPU (tensor parallelism 1)"
    if attn.qkv_proj.bias is not None or attn.q_norm is not None:
        return "the fused head step supports neither attention biases nor q/k norms"
    return fused_attention_unsupported("fused head", cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)


class FusedHead:
    """Eagle3Head's forward for a padded batch of B·T ≤ max_rows tokens (T ≤ max_seq_rows), as fused
    kernels."""

    def __init__(self, head: Eagle3Head, pdl: bool | None = None, few_rows: int | None = None) -> None:
        """pdl: programmatic dependent launch for every step (True, False), or per step as the
        fused target decides it (None: specsplit.models.fused.pdl_pays); few_rows: steps of up to
        this many rows run kernels.few (None: HEAD_FEW_ROWS)."""
        reason = fused_head_unsupported(head)
        if reason:
            raise ValueError(reason)
        # Triton: imported only when made
        from specsplit.models.kernels import few, projections, verify
        from specsplit.models.kernels import head as head_kernels

        self.head, self.pdl, self.proj, self.attn, self.few = head, pdl, projections, verify, few
        default = few_rows_default(head.cfg.hidden_size, HEAD_FEW_ROWS)
        self.few_rows = min(FEW_ROWS_MAX, default if few_rows is None else few_rows)
        self.input = head_kernels.head_input
        dev = head.fc.weight.device
        self.capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else (0, 0)
        self.max_rows, self.max_seq_rows = verify.MAX_ROWS, verify.SEQ_ROWS
        self.ws = projections.Workspace(dev)

    def takes(self, b: int, t: int) -> bool:
        """Whether a step of b sequences of t tokens fits."""
        return b * t <= self.max_rows and t <= self.max_seq_rows

    def forward(self, tokens: torch.Tensor, batch: Batch, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B*T] and batch.hidden [B*T, 3H] (target features) or [B*T, H] (pre-norm
        states) of a padded batch -> draft-vocab logits [B*T, Vd] float32, pre-norm states
        [B*T, H], as Eagle3Head.forward. Each token writes its entry of batch.entries (consecutive
        per sequence) and sees what batch.visible names, else the committed entries and the step's
        tokens up to its own."""
        m, cfg, k, ws = self.head, self.head.cfg, self.proj, self.ws
        n = tokens.shape[0]
        pdl = self.pdl if self.pdl is not None else pdl_pays(cfg.hidden_size, n, self.capability)
        if (not batch.is_padded or batch.entries is None or batch.entries.numel() != n
                or not self.takes(*batch.entries.shape)):
            raise ValueError(f"a fused head step takes a padded batch of at most {self.max_rows} tokens, "
                             f"{self.max_seq_rows} a sequence, got {n}")
        if batch.tree_mask is not None and batch.visible is None:
            raise ValueError("a fused head step takes a tree's view as batch.visible, not as a tree mask")
        assert batch.slots is not None and batch.hidden is not None
        b, t = batch.entries.shape
        mid, eps = m.midlayer, cfg.rms_norm_eps
        hidden = batch.hidden
        if hidden.shape[-1] != cfg.hidden_size:
            hidden = m.fc(hidden.to(m.fc.weight.dtype))  # [N, H]
        hidden = hidden.contiguous()  # the residual of o_proj: read row by row
        # views of packed inputs, read by the kernels as contiguous
        positions, entries, slots = batch.positions.contiguous(), batch.entries.contiguous(), batch.slots.contiguous()
        x = self.input(tokens, m.embed_tokens.weight, hidden, mid.input_layernorm.weight, mid.hidden_norm.weight,
                       eps)  # [N, 2H]
        qkv = F.linear(x, mid.self_attn.qkv_proj.weight)  # [N, (Hq + 2 Hkv) * D]
        mask = visible = None
        if batch.visible is not None:
            visible = batch.visible.contiguous()
        else:
            mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril().expand(b, t, t).contiguous()
        shard = mid.self_attn.shard
        o = self.attn.tree_attention(qkv, m.rotary.cos, m.rotary.sin, positions, entries, slots,
                                     mask, cache.k[0], cache.v[0], shard.q_count, shard.kv_count, ws.counters, ws.sms,
                                     pdl, visible=visible)  # [N, Hq * D]
        if n <= self.few_rows:
            f = self.few
            h = f.gemv_residual(o, mid.self_attn.o_proj.weight, hidden, pdl)  # [N, H]
            a = f.gate_up_silu(h, mid.mlp.gate_up_proj.weight, mid.post_attention_layernorm.weight, eps, pdl)
            prenorm = f.gemv_residual(a, mid.mlp.down_proj.weight, h, pdl)
            logits = f.norm_gemv(prenorm, m.lm_head.weight, m.norm.weight, eps, pdl, torch.float32)
            return logits[:, : m.lm_head.vocab], prenorm
        h, normed = k.mm_residual(o, mid.self_attn.o_proj.weight, hidden, pdl, ws,
                                  mid.post_attention_layernorm.weight)
        assert normed is not None
        a = k.gate_up_silu(normed, mid.mlp.gate_up_proj.weight, eps, pdl, ws)  # [N, I]
        prenorm, normed = k.mm_residual(a, mid.mlp.down_proj.weight, h, pdl, ws, m.norm.weight)
        assert normed is not None
        logits = k.norm_mm(normed, m.lm_head.weight, eps, pdl, torch.float32, ws)[:, : m.lm_head.vocab]
        return logits, prenorm


def fused_head(head: Eagle3Head, mode: str) -> FusedHead | None:
    """The head's fused step for --fused-head `mode` (auto, on, off) on CUDA: None for off, or for
    auto where it does not run (a head it does not support, no Triton; logged); on raises there."""
    if mode == "off":
        return None
    reason = fused_head_unsupported(head)
    if reason is None:
        try:
            return FusedHead(head)
        except ImportError as e:
            reason = str(e)
    if mode == "on":
        raise ValueError(f"--fused-head on: {reason}")
    log.info("the draft's fused head step does not run here (%s): the padded path", reason)
    return None


def level_kernel(head: Eagle3Head) -> Callable[..., tuple[torch.Tensor, ...]]:
    """kernels.tree.tree_level with the head's draft-to-target id map bound."""
    from specsplit.models.kernels.tree import tree_level  # Triton: the fused head imports it too

    def level(lp: torch.Tensor, ids: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, ...]:
        return tree_level(lp, ids, head.d2t, *rest)

    return level

