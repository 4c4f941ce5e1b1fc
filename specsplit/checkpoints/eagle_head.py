"""EAGLE-3 heads in the SGLang / SpecForge format: a directory with config.json
(`LlamaForCausalLMEagle3`) and model.safetensors (fc, midlayer.*, norm, lm_head, d2t, t2d)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specsplit.checkpoints.target_checkpoint import cache_root, load_target_config, resolve_target_dir
from specsplit.models.config import Eagle3Config, LlamaConfig

RANDOM_HEAD = "random"
DEFAULT_HEAD = "default"  # the shipped trained head when the target is the one it was trained for, else random
SHIPPED_HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"
# name -> (directory in specsplit/heads, the target's config name it was trained on)
SHIPPED_HEADS = {
    "smollm2-eagle3": ("smollm2_135m_instruct_eagle3", "Smollm2 135M 8k Lc100K Mix1 Ep2"),
}


def load_head(head_dir: str | Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    head_dir = Path(head_dir)
    cfg_path = head_dir / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{head_dir}: no config.json (expected an EAGLE-3 head directory)")
    raw = json.loads(cfg_path.read_text())
    arch = (raw.get("architectures") or [""])[0]
    if "Eagle3" not in arch and "eagle_config" not in raw and "draft_vocab_size" not in raw:
        raise ValueError(f"{head_dir}: {arch!r} does not look like an EAGLE-3 head")
    cfg = Eagle3Config.from_hf(raw, name=raw.get("_name_or_path") or head_dir.name)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(head_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    if not weights and (head_dir / "pytorch_model.bin").exists():
        weights = torch.load(head_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    if not weights:
        raise FileNotFoundError(f"{head_dir}: no weights (model.safetensors or pytorch_model.bin)")
    return cfg, {k.removeprefix("model."): v for k, v in weights.items()}


def save_head(out: str | Path, cfg: Eagle3Config, weights: dict[str, torch.Tensor]) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf = cfg.to_hf()
    hf["_name_or_path"] = cfg.name
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors")


def random_head(target: LlamaConfig, draft_vocab_size: int = 8192, seed: int = 0, std: float = 0.02,
                aux_layer_ids: list[int] | None = None, name: str = "random-eagle3"
                ) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """A randomly initialised head shaped for `target` (for tests, until a trained one exists).
    The draft vocabulary is a random subset of target ids, so d2t is exercised."""
    vd = min(draft_vocab_size, target.vocab_size)
    cfg = Eagle3Config(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                       num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, vocab_size=target.vocab_size,
                       draft_vocab_size=vd, head_dim=target.head_dim, rope_theta=target.rope_theta,
                       rope_scaling=target.rope_scaling, rms_norm_eps=target.rms_norm_eps,
                       max_position=target.max_position, aux_layer_ids=aux_layer_ids, name=name)
    g = torch.Generator().manual_seed(seed)
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    ids = torch.randperm(target.vocab_size, generator=g)[:vd].sort().values
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    weights = {
        "fc.weight": rnd(h, 3 * h),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": rnd(cfg.num_heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": rnd(cfg.num_kv_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": rnd(cfg.num_kv_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": rnd(h, cfg.num_heads * d),
        "midlayer.mlp.gate_proj.weight": rnd(i, h),
        "midlayer.mlp.up_proj.weight": rnd(i, h),
        "midlayer.mlp.down_proj.weight": rnd(h, i),
        "norm.weight": torch.ones(h),
        "lm_head.weight": rnd(vd, h),
        "d2t": ids - torch.arange(vd),
        "t2d": t2d,
    }
    return cfg, weights


def shipped_head_for(target_spec: str) -> str | None:
    """The name of the shipped trained head for this target, or None (matched by the target's
    config name and shapes: the embedded SmolLM2 GGUF, from the package or copied elsewhere)."""
    target_dir = resolve_target_dir(target_spec)
    raw = json.loads((target_dir / "config.json").read_text())
    for name, (dirname, target_name) in SHIPPED_HEADS.items():
        head = json.loads((SHIPPED_HEADS_DIR / dirname / "config.json").read_text())
        if raw.get("_name_or_path") == target_name and raw.get("hidden_size") == head["target_hidden_size"] \
                and raw.get("vocab_size") == head["vocab_size"]:
            return name
    return None


def _concrete(head: str, target_spec: str) -> str:
    """`default` -> the shipped head's name for this target, or `random`; any other value as it is."""
    return (shipped_head_for(target_spec) or RANDOM_HEAD) if head == DEFAULT_HEAD else head


def trained_head_dir(head: str, target_spec: str) -> Path | None:
    """The directory `head` names unless it resolves to a random head (then None, nothing is made)."""
    head = _concrete(head, target_spec)
    return None if head == RANDOM_HEAD else resolve_head_dir(head, target_spec)


def resolve_head_dir(head: str, target_spec: str, seed: int = 0) -> Path:
    """The directory of a head given as: a directory; the name of a shipped head (`smollm2-eagle3`);
    `default` (the shipped head trained for this target if there is one, else `random`); or
    `random` (a random head for the target, made once in the cache)."""
    head = _concrete(head, target_spec)
    if head in SHIPPED_HEADS:
        return SHIPPED_HEADS_DIR / SHIPPED_HEADS[head][0]
    if head != RANDOM_HEAD:
        if not Path(head).is_dir():
            raise FileNotFoundError(f"head {head!r}: not a directory, {DEFAULT_HEAD!r}, {RANDOM_HEAD!r} or a shipped "
                                    f"head ({', '.join(SHIPPED_HEADS)})")
        return Path(head)
    target_dir = resolve_target_dir(target_spec)
    out = cache_root() / f"random-head-{target_dir.name}-s{seed}"
    if not (out / "config.json").exists():
        cfg, weights = random_head(load_target_config(target_dir), seed=seed)
        tmp = Path(tempfile.mkdtemp(prefix=".head-", dir=cache_root()))
        try:
            save_head(tmp, cfg, weights)
            try:
                tmp.rename(out)
            except OSError:
                if not (out / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
