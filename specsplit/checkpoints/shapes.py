"""Model shapes with random weights, for timing at sizes that are not shipped.

`shape:llama-3.1-8b` (`-70b`, `smollm2-135m`) names a target directory holding only config.json and
random_weights.json: the target service initialises its shard on its own GPU from a seed
(seconds, no 16 GB file), and the draft borrows a seeded random embedding table.
Acceptance on random weights means nothing: benchmarks on them replay an acceptance profile.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specsplit.models.config import LlamaConfig

SHAPE_PREFIX = "shape:"
RANDOM_WEIGHTS_FILE = "random_weights.json"

SHAPES: dict[str, LlamaConfig] = {
    "llama-3.1-8b": LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, vocab_size=128256,
        rope_theta=500000.0, max_position=8192, name="llama-3.1-8b-shape", eos_token_ids=[128001],
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
    "llama-3.1-70b": LlamaConfig(
        hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8, vocab_size=128256,
        rope_theta=500000.0, max_position=8192, name="llama-3.1-70b-shape", eos_token_ids=[128001],
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}),
    # SmolLM2-135M-Instruct's shape: the shipped head's target, for timing without its 94 MiB file
    "smollm2-135m": LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, vocab_size=49152,
        rope_theta=100000.0, max_position=8192, tie_word_embeddings=True, name="smollm2-135m-shape",
        bos_token_id=1, eos_token_ids=[2]),
}


def write_shape_target(name: str, out: Path, seed: int = 0, std: float = 0.02) -> Path:
    if name not in SHAPES:
        raise FileNotFoundError(f"unknown model shape {name!r}; known: {sorted(SHAPES)}")
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        hf = SHAPES[name].to_hf()
        hf["_name_or_path"] = SHAPES[name].name
        (out / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed, "std": std}))
        (out / "config.json").write_text(json.dumps(hf, indent=1))
    return out


def random_weights_spec(model_dir: Path) -> dict[str, float] | None:
    path = model_dir / RANDOM_WEIGHTS_FILE
    return json.loads(path.read_text()) if path.exists() else None


@torch.no_grad()
def init_random_(model: nn.Module, seed: int, std: float) -> None:
    """Normal(0, std) matrices and unit norms, generated where the parameters live."""
    for i, param in enumerate(model.parameters()):
        g = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + i)
        if param.dim() > 1:
            param.normal_(0.0, std, generator=g)
        else:
            param.fill_(1.0)


def random_embedding(cfg: LlamaConfig, seed: int, std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * std
