"""Tiny random Llama targets (for tests and CPU benchmarks): a config.json plus
model.safetensors in Hugging Face layout."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from specsplit.models.config import LlamaConfig
from specsplit.models.llama import random_llama_weights


def tiny_config(vocab: int = 512, hidden: int = 64, layers: int = 6, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 128) -> LlamaConfig:
    return LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, vocab_size=vocab, rope_theta=10000.0, max_position=4096,
                       eos_token_ids=[vocab - 1], bos_token_id=0, name="tiny-llama")


def write_tiny_target(out: str | Path, cfg: LlamaConfig | None = None, seed: int = 0, std: float = 0.2) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = cfg or tiny_config()
    (out / "config.json").write_text(json.dumps({**cfg.to_hf(), "_name_or_path": cfg.name}, indent=1))
    save_file(random_llama_weights(cfg, seed=seed, std=std), out / "model.safetensors")
    return out
