from __future__ import annotations

from pathlib import Path

from gateway.detok import IncrementalDetokenizer
from specsplit.tokenizer import TextCodec


def test_chat_template_and_round_trip(smollm2_dir: Path) -> None:
    codec = TextCodec.from_checkpoint(smollm2_dir)
    assert codec is not None
    text = codec.render_chat("Hi there 123")
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    ids = codec.encode(text)
    assert ids[0] == 1 and codec.decode(ids) == text
    assert codec.encode("123") == [codec.encode("1")[0], codec.encode("2")[0], codec.encode("3")[0]]  # digit split


def test_incremental_detokenizer_waits_for_complete_characters(smollm2_dir: Path) -> None:
    codec = TextCodec.from_checkpoint(smollm2_dir)
    text = "naïve café ☕ — 東京 done"
    ids = codec.encode(text)
    detok = IncrementalDetokenizer(codec)
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
