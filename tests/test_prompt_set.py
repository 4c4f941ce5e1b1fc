"""The shipped prompt set: reproducible, held-out chat prompts disjoint from training, no
HumanEval text, and prompts that render through the chat template."""

from __future__ import annotations

import gzip
import json
import re

from specsplit.tokenizer import TextCodec
from specsplit.training.prompt_bank import HELDOUT_EVERY, SHIPPED, build
from specsplit.training.prompt_topics import ACTIVITIES, TOPICS
from specsplit.training.prompts import encode, load_records, select


def test_shipped_file_is_the_builder_output() -> None:
    with gzip.open(SHIPPED, "rt") as f:
        shipped = [json.loads(line) for line in f]
    assert shipped == build()
    assert sum(r["split"] == "train" for r in shipped) >= 10_000


def test_heldout_topics_never_appear_in_training_prompts() -> None:
    records = load_records()
    train = [r["text"] for r in records if r["split"] == "train"]
    held = [r["text"] for r in records if r["split"] == "heldout"]
    assert held and not set(held) & set(train)
    # the prompts built from topics and activities never use a held-out one
    filled = " | ".join(r["text"] for r in records if r["kind"] in ("explain", "list", "writing"))
    train_items = {t for i, t in enumerate(TOPICS) if i % HELDOUT_EVERY} | {
        t for i, t in enumerate(ACTIVITIES) if i % HELDOUT_EVERY}
    for item in TOPICS[::HELDOUT_EVERY] + ACTIVITIES[::HELDOUT_EVERY]:
        if not any(re.search(rf"\b{re.escape(item)}\b", other) for other in train_items):
            assert not re.search(rf"\b{re.escape(item)}\b", filled), item


def test_select_and_encode(tmp_path) -> None:  # noqa: ANN001
    records = load_records()
    a, b = select(records, "train", 50, seed=3), select(records, "train", 50, seed=3)
    assert a == b and len(a) == 50 and all(r["split"] == "train" for r in a)
    ids = encode(a, None, 512, 16)  # no tokenizer: bytes folded into the vocabulary
    assert all(0 < t < 511 for seq in ids for t in seq) and max(len(s) for s in ids) == 16
    custom = tmp_path / "p.jsonl"
    custom.write_text('"Hello there"\n{"text": "raw text", "raw": true}\n')
    assert [r["raw"] for r in load_records(str(custom))] == [False, True]


def test_chat_rendering_with_smollm2_tokenizer(smollm2_dir) -> None:  # noqa: ANN001
    codec = TextCodec.from_checkpoint(smollm2_dir)
    recs = [{"text": "Explain tides.", "raw": False}, {"text": "def f(x):\n    pass\n", "raw": True}]
    chat, raw = encode(recs, codec, 49152, 384)
    assert codec.decode(chat).startswith("<|im_start|>") and codec.decode(chat).endswith("assistant\n")
    assert codec.decode(raw) == "def f(x):\n    pass\n"
