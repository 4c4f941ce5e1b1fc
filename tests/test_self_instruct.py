"""Requests written by the target itself (`train-head --self-instruct`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specsplit.tokenizer import TextCodec
from specsplit.training.config import TrainConfig
from specsplit.training.pipeline import run
from specsplit.training.self_instruct import clean, pre_query_prefix, synthesize
from specsplit.training.target import BatchedTarget


def test_pre_query_prefix_ends_where_the_user_speaks(smollm2_dir: Path) -> None:
    codec = TextCodec.from_checkpoint(smollm2_dir)
    assert codec is not None
    prefix = pre_query_prefix(codec)
    assert prefix.endswith("<|im_start|>user\n") and codec.render_chat("hi").startswith(prefix)


def test_clean_cuts_special_tokens_and_drops_fragments() -> None:
    assert clean("How do tides work?<|im_end|>\n<|im_start|>assistant") == "How do tides work?"
    assert clean("  Explain recursion with an example.  ") == "Explain recursion with an example."
    assert clean("Hi there") is None  # too short
    assert clean("<|im_end|>") is None
    assert clean("word " * 400) is None  # too long


def test_synthesize_gives_distinct_clean_requests(smollm2_dir: Path) -> None:
    torch.manual_seed(0)
    codec = TextCodec.from_checkpoint(smollm2_dir)
    assert codec is not None
    target = BatchedTarget.load(str(smollm2_dir), "cpu", torch.float32)
    texts, stats = synthesize(target, codec, 6, 12, 6, 1.0, seed=3, deadline=None)
    assert stats.prompts == 6 and 0 < len(texts) <= 6 and len(set(texts)) == len(texts)
    assert all(clean(t) == t and "<|" not in t for t in texts)


def test_self_instruct_needs_a_chat_template(tiny_target: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(out=str(tmp_path / "h"), target=str(tiny_target), self_instruct=4, num_prompts=4,
                      max_new_tokens=4, time_budget=30, device="cpu")
    with pytest.raises(ValueError, match="self_instruct needs the target's tokenizer"):
        run(cfg)


def test_self_instruct_settings_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="self_instruct needs"):
        TrainConfig(out=str(tmp_path), self_instruct=8, self_instruct_temperature=0.0, max_steps=1).validate()
