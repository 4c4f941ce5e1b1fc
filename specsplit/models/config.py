"""Model configurations: the Llama-family target and the EAGLE-3 head."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LlamaConfig:
    """Shape of a Llama-family decoder (Llama 3.x, Qwen2/3, Mistral, SmolLM2)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # llama3 frequency scaling
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v biases
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    max_position: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    def default_aux_layer_ids(self) -> list[int]:
        """EAGLE-3 default capture: the outputs of layers 1, N/2-1 and N-4."""
        n = self.num_layers
        return [1, n // 2 - 1, n - 4] if n >= 6 else [0, max(n // 2 - 1, 0), n - 1]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "") -> LlamaConfig:
        """From a Hugging Face config.json (LlamaForCausalLM, Qwen2/3, Mistral)."""
        arch = (cfg.get("architectures") or [""])[0]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            vocab_size=cfg["vocab_size"],
            head_dim=cfg.get("head_dim") or 0,
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch.startswith("Qwen2"))),
            qk_norm=arch.startswith("Qwen3"),
            max_position=int(cfg.get("max_position_embeddings", 8192)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name or cfg.get("_name_or_path", "") or arch or "llama",
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids,
        }


UNSUPPORTED_HEAD_OPTIONS = ("fc_norm", "use_aux_norm", "norm_before_fc", "norm_output")


@dataclass
class Eagle3Config:
    """An EAGLE-3 head (SGLang / SpecForge `LlamaForCausalLMEagle3` config.json)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    head_dim: int = 0
    target_hidden_size: int = 0  # 0: same as hidden_size
    num_layers: int = 1
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    max_position: int = 8192
    tie_word_embeddings: bool = False
    aux_layer_ids: list[int] | None = None  # eagle_config.eagle_aux_hidden_state_layer_ids
    fc_bias: bool = False
    name: str = "eagle3"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.target_hidden_size == 0:
            self.target_hidden_size = self.hidden_size
        if self.num_layers != 1:
            raise ValueError("only single-layer EAGLE-3 heads are supported")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "") -> Eagle3Config:
        eagle = cfg.get("eagle_config") or {}
        # options SGLang reads that change what the head computes: refuse rather than draft differently
        for key in UNSUPPORTED_HEAD_OPTIONS:
            if cfg.get(key) or eagle.get(key):
                raise ValueError(f"EAGLE-3 head option {key!r} is not supported by specsplit (docs/compatibility.md)")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and len(ids) != 3:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids names {len(ids)} layers; an EAGLE-3 head takes 3")
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            head_dim=cfg.get("head_dim") or 0,
            target_hidden_size=cfg.get("target_hidden_size") or 0,
            num_layers=cfg.get("num_hidden_layers", 1),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            aux_layer_ids=ids,
            fc_bias=bool(cfg.get("bias", False)),
            name=name or cfg.get("_name_or_path", "") or "eagle3",
        )

    def to_hf(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.aux_layer_ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        return cfg
