"""Triton kernel of the EAGLE-3 head's input (specsplit.models.fused_head): each token's row
[rms_norm(E[token])·w_e, rms_norm(h)·w_h], the attention's 2H-wide input, in one kernel instead of
an embedding lookup, two norms and a concatenation. The norms are computed in float32 and rounded
once to the activations' dtype, as torch's fused RMS norm does."""

import torch
import triton
import triton.language as tl


@triton.jit
def _head_input(tok_ptr, e_ptr, h_ptr, we_ptr, wh_ptr, out_ptr, H, stride_e, stride_h, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < H
    token = tl.load(tok_ptr + row)
    e = tl.load(e_ptr + token * stride_e + c, mask=ok, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + row * stride_h + c, mask=ok, other=0.0).to(tl.float32)
    we = tl.load(we_ptr + c, mask=ok, other=0.0).to(tl.float32)
    wh = tl.load(wh_ptr + c, mask=ok, other=0.0).to(tl.float32)
    e_rstd = 1.0 / tl.sqrt(tl.sum(e * e, axis=0) / H + eps)
    h_rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * 2 * H + c, (e * e_rstd * we).to(dt), mask=ok)
    tl.store(out_ptr + row * 2 * H + H + c, (h * h_rstd * wh).to(dt), mask=ok)


def head_input(tokens: torch.Tensor, embedding: torch.Tensor, hidden: torch.Tensor, embed_norm: torch.Tensor,
               hidden_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """tokens [N], embedding [V, H], hidden [N, H], the two norms' weights [H] -> [N, 2H] in
    hidden's dtype: [rms_norm(embedding[tokens], embed_norm), rms_norm(hidden, hidden_norm)]."""
    (n,), h = tokens.shape, hidden.shape[-1]
    out = torch.empty(n, 2 * h, dtype=hidden.dtype, device=hidden.device)
    block = triton.next_power_of_2(h)
    if n:
        _head_input[(n,)](tokens.contiguous(), embedding, hidden, embed_norm, hidden_norm, out, h, embedding.stride(0),
                          hidden.stride(0), eps, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return out
