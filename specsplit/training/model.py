"""The trainable EAGLE-3 head, unrolled for training-time test (TTT).

The modules are the inference head's (specsplit.models.eagle3.Eagle3MidLayer: its norms,
merged qkv_proj, o_proj and gate_up_proj / down_proj MLP; RMSNorm and Rotary), so the
computation is the inference head's, made batched over [B, N] and unrolled over K steps;
only the attention pattern is this module's. `export()` splits the merged projections back
into the SGLang / SpecForge checkpoint keys. Alignment, for training position i:

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
from specsplit.models.eagle3 import Eagle3MidLayer
from specsplit.models.layers import RMSNorm, Rotary
from specsplit.models.parallel import MergedColumnParallelLinear, TensorParallel
from specsplit.training.vocab import DraftVocab

# merged projections of the serving layers -> the checkpoint's separate ones, in row order
CHECKPOINT_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


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
        self.midlayer = Eagle3MidLayer(cfg, TensorParallel())  # the serving layer's modules; not its forward
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("embed", embed.detach(), persistent=False)  # the target's, frozen [V, H]
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)

    def init_from_target(self, lm_head: torch.Tensor, final_norm: torch.Tensor, vocab: DraftVocab) -> None:
        """Start the output layer where the target's is: its lm_head rows of the draft vocabulary."""
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head[vocab.ids.to(lm_head.device)].float())
            self.norm.weight.copy_(final_norm.float())

    @staticmethod
    def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """norm(x) in the weights' dtype: in fp32 under autocast (fp32 master weights), whatever the
        device's autocast policy for rms_norm, and with no input / weight dtype mismatch."""
        return norm(x.to(norm.weight.dtype))

    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor, pos0: int, keys: list[torch.Tensor],
              values: list[torch.Tensor]) -> torch.Tensor:
        """One unrolled step: hidden [B, N, H], tokens [B, N] at RoPE positions pos0.. -> pre-norm [B, N, H].
        The serving midlayer's computation over the B * N tokens flattened, with ttt_attention."""
        m, a = self.midlayer, self.midlayer.self_attn
        b, n, _ = hidden.shape
        h = hidden.reshape(b * n, -1)
        x = torch.cat([self._norm(m.input_layernorm, self.embed[tokens.flatten()]), self._norm(m.hidden_norm, h)],
                      dim=-1)  # [B * N, 2H]
        rope = self.rotary.tables(torch.arange(pos0, pos0 + n, device=h.device).repeat(b), h.dtype)
        q, k, v = (y.view(b, n, -1, a.head_dim).transpose(1, 2) for y in a.project(x, rope))  # [B, heads, N, D]
        keys.append(k)
        values.append(v)
        h = h + a.o_proj(ttt_attention(q, keys, values).transpose(1, 2).reshape(b * n, -1))
        return (h + m.mlp(self._norm(m.post_attention_layernorm, h))).view(b, n, -1)

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
            yield self.lm_head(self._norm(self.norm, hidden))

    def export(self, vocab: DraftVocab, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """SGLang / SpecForge weights: fc, midlayer.*, norm, lm_head in `dtype` (merged projections
        split back into q/k/v_proj and gate/up_proj); d2t, t2d."""
        out = {}
        for name, value in self.state_dict().items():
            module, _, leaf = name.rpartition(".")  # e.g. midlayer.self_attn.qkv_proj, weight
            parent, _, short = module.rpartition(".")
            merged = self.get_submodule(module) if short in CHECKPOINT_PARTS else None
            if isinstance(merged, MergedColumnParallelLinear):
                for part, rows in zip(CHECKPOINT_PARTS[short], value.split(merged.sizes), strict=True):
                    out[f"{parent}.{part}.{leaf}"] = rows
            else:
                out[name] = value
        out = {k: v.detach().to("cpu", dtype).contiguous() for k, v in out.items()}
        out["d2t"], out["t2d"] = vocab.d2t.clone(), vocab.t2d.clone()
        return out


def head_config(target: LlamaConfig, draft_vocab_size: int, aux_layer_ids: list[int], name: str) -> Eagle3Config:
    """A head shaped like one target layer (as the released EAGLE-3 heads are)."""
    return Eagle3Config(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                        num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, vocab_size=target.vocab_size,
                        draft_vocab_size=draft_vocab_size, head_dim=target.head_dim, rope_theta=target.rope_theta,
                        rope_scaling=target.rope_scaling, rms_norm_eps=target.rms_norm_eps,
                        max_position=target.max_position, aux_layer_ids=list(aux_layer_ids), name=name)
