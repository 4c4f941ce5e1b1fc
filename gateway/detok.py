"""Incremental detokenization: emit text only once its UTF-8 bytes are complete."""

from __future__ import annotations

from specsplit.tokenizer import TextCodec


class IncrementalDetokenizer:
    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # window start, kept a few tokens back for merge context
        self.read = 0  # tokens already turned into text

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self.codec.decode(self.ids[self.prefix : self.read])
        after = self.codec.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        before = self.codec.decode(self.ids[self.prefix : self.read])
        after = self.codec.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]
