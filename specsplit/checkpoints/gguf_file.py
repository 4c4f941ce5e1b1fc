"""Llama-family GGUF files: config from metadata, dequantized Hugging Face-named weights,
and the tokenizer and chat template stored in the metadata."""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from specsplit.models.config import LlamaConfig

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not m or m.group(2) not in _LAYER_NAMES:
        raise KeyError(f"unknown GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rope) back to Hugging Face's
    rotate_half layout: rows (head, pair, 2) -> (head, 2, pair)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = GGUFReader(str(self.path))
        self.arch = self.meta("general.architecture")
        if self.arch not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ValueError(f"{self.path}: unsupported GGUF architecture {self.arch!r}")

    def meta(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    @cached_property
    def config(self) -> LlamaConfig:
        a = self.arch
        names = {t.name for t in self.reader.tensors}
        heads = int(self.meta(f"{a}.attention.head_count"))
        hidden = int(self.meta(f"{a}.embedding_length"))
        eos = self.meta("tokenizer.ggml.eos_token_id")
        return LlamaConfig(
            hidden_size=hidden,
            intermediate_size=int(self.meta(f"{a}.feed_forward_length")),
            num_layers=int(self.meta(f"{a}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self.meta(f"{a}.attention.head_count_kv", heads)),
            vocab_size=int(self.meta(f"{a}.vocab_size", 0)) or len(self.meta("tokenizer.ggml.tokens")),
            head_dim=int(self.meta(f"{a}.attention.key_length", 0)) or hidden // heads,
            rope_theta=float(self.meta(f"{a}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(self.meta(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            max_position=int(self.meta(f"{a}.context_length", 8192)),
            bos_token_id=self.meta("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [int(eos)],
            name=str(self.meta("general.name", self.path.stem)),
        )

    def tensor(self, gguf_name: str) -> torch.Tensor:
        """One tensor, dequantized to float32, in PyTorch [out, in] orientation."""
        t = next((t for t in self.reader.tensors if t.name == gguf_name), None)
        if t is None:
            raise KeyError(f"{self.path}: no tensor {gguf_name!r}")
        return self._convert(t)

    def _convert(self, t: Any) -> torch.Tensor:
        shape = tuple(int(x) for x in reversed(t.shape))
        arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        w = torch.from_numpy(arr)
        # llama.cpp permutes q/k rows for the llama architecture only
        if self.arch in ("llama", "mistral") and re.fullmatch(r"blk\.\d+\.attn_[qk]\.(weight|bias)", t.name):
            cfg = self.config
            w = unpermute_rope(w, cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads)
        return w

    def weights(self) -> dict[str, torch.Tensor]:
        return {hf_name(t.name): self._convert(t) for t in self.reader.tensors}

    def tokenizer_json(self) -> str:
        return gguf_tokenizer_json(self)


_CONTROL = 3  # llama.cpp token type of special tokens


def gguf_tokenizer_json(ckpt: GGUFCheckpoint) -> str:
    """Build a byte-level BPE tokenizer (GPT-2 style, as SmolLM2 and Llama 3 use)."""
    if ckpt.meta("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {ckpt.meta('tokenizer.ggml.model')!r}")
    tokens: list[str] = list(ckpt.meta("tokenizer.ggml.tokens"))
    types = list(ckpt.meta("tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in ckpt.meta("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if ckpt.meta("tokenizer.ggml.pre") == "smollm":  # digits split one by one, then GPT-2 regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL])
    return tok.to_str()
