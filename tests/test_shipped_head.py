"""The trained SmolLM2 head shipped in the package: how `--head` names resolve, its format and
size, and that it drafts losslessly with real acceptance on the real model (fp32, CPU)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from draft_service.config import DraftConfig
from gateway.local import LocalEngines
from specsplit.checkpoints.eagle_head import (
    DEFAULT_HEAD,
    RANDOM_HEAD,
    SHIPPED_HEADS_DIR,
    load_head,
    resolve_head_dir,
    shipped_head_for,
    trained_head_dir,
)
from specsplit.checkpoints.target_checkpoint import embedded_smollm2_gguf, gguf_digest, resolve_target_dir
from specsplit.tokenizer import TextCodec
from target_service.config import TargetConfig
from tests.test_lossless import CHAT_PROMPTS, check_lossless

SHIPPED = SHIPPED_HEADS_DIR / "smollm2_135m_instruct_eagle3"


def test_default_head_is_the_shipped_one_for_smollm2_and_random_otherwise(tiny_target: Path) -> None:
    assert shipped_head_for("smollm2") == "smollm2-eagle3"
    assert resolve_head_dir(DEFAULT_HEAD, "smollm2") == SHIPPED
    assert trained_head_dir(DEFAULT_HEAD, "smollm2") == SHIPPED
    assert resolve_head_dir("smollm2-eagle3", str(tiny_target)) == SHIPPED  # by name: no target check
    assert shipped_head_for(str(tiny_target)) is None
    assert trained_head_dir(DEFAULT_HEAD, str(tiny_target)) is None  # nothing is made for it
    assert resolve_head_dir(DEFAULT_HEAD, str(tiny_target)).name.startswith("random-head-")
    assert DraftConfig().head == DEFAULT_HEAD and trained_head_dir(RANDOM_HEAD, "smollm2") is None


def test_the_same_gguf_elsewhere_gets_the_shipped_head(tmp_path: Path) -> None:
    copy = tmp_path / "model.gguf"
    shutil.copyfile(embedded_smollm2_gguf(), copy)
    assert resolve_head_dir(DEFAULT_HEAD, str(copy)) == SHIPPED
    # the conversion cache is keyed by content: the copy reuses the embedded model's conversion
    assert resolve_target_dir(str(copy)) == resolve_target_dir("smollm2")


def test_gguf_digest_is_the_content_hash_and_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "x.gguf"
    f.write_bytes(b"abc" * 1000)
    assert gguf_digest(f) == hashlib.sha256(b"abc" * 1000).hexdigest()
    (memo,) = (tmp_path / "cache" / "digests").iterdir()
    memo.write_text("f" * 64)  # a remembered digest is used while path, size and mtime are unchanged
    assert gguf_digest(f) == "f" * 64
    f.write_bytes(b"abcd" * 1000)  # new size (and mtime): hashed again
    assert gguf_digest(f) == hashlib.sha256(b"abcd" * 1000).hexdigest()


def test_unknown_head_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="not a directory, 'default', 'random' or a shipped head"):
        resolve_head_dir("/no/such/head", "smollm2")


def test_shipped_head_format_and_size() -> None:
    weights = SHIPPED / "model.safetensors"
    assert weights.stat().st_size <= 30_000_000
    cfg, w = load_head(SHIPPED)
    assert cfg.draft_vocab_size == 8192 and cfg.aux_layer_ids == [1, 14, 26] and cfg.target_hidden_size == 576
    with safe_open(weights, "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.self_attn.q_proj.weight"} <= keys
    assert not any(k.startswith("embed") for k in keys)  # drafts with the target's embedding


@pytest.mark.slow
def test_shipped_head_is_lossless_and_accepts(smollm2_dir: Path) -> None:
    engines = LocalEngines(TargetConfig(model=str(smollm2_dir), max_context=512, dtype="float32",
                                        draft_config=str(SHIPPED / "config.json")),
                           DraftConfig(head=DEFAULT_HEAD, target=str(smollm2_dir), max_context=512))
    try:
        codec = TextCodec.from_checkpoint(smollm2_dir)
        prompts = [codec.encode(codec.render_chat(p)) for p in CHAT_PROMPTS]
        taus = check_lossless(engines, prompts, 32, {2}, range(3, 6, 2))
    finally:
        engines.close()
    assert sum(taus) / len(taus) > 1.3, taus  # a random head accepts nothing (tau 1.0)
