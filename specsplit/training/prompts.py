"""Load the prompt set and turn prompts into token ids (through the chat template unless raw)."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from specsplit.tokenizer import TextCodec
from specsplit.training.prompt_bank import SHIPPED

BUILTIN = "builtin"


def load_records(source: str = BUILTIN) -> list[dict]:
    """Records {text, split, kind, raw} from the shipped set or a .jsonl / .jsonl.gz file
    (a line may also be a bare JSON string, taken as a chat prompt of the train split)."""
    path = SHIPPED if source == BUILTIN else Path(source)
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if isinstance(r, str):
                r = {"text": r}
            out.append({"split": "train", "kind": "chat", "raw": False, **r})
    return out


def select(records: list[dict], split: str, count: int, seed: int) -> list[dict]:
    """`count` records of one split in a seeded random order (all of them when count <= 0)."""
    chosen = [r for r in records if r["split"] == split]
    random.Random(seed).shuffle(chosen)
    return chosen if count <= 0 else chosen[:count]


def encode(records: list[dict], codec: TextCodec | None, vocab_size: int, max_tokens: int) -> list[list[int]]:
    """Token ids per prompt, cut to the last `max_tokens`. Without a tokenizer (tiny test
    targets) the UTF-8 bytes stand in for tokens, folded into the vocabulary."""
    out = []
    for r in records:
        if codec is None:
            ids = [1 + b % (vocab_size - 2) for b in r["text"].encode()]
        else:
            ids = codec.encode(r["text"] if r.get("raw") else codec.render_chat(r["text"]))
        out.append(ids[-max_tokens:])
    return out
