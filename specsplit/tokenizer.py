"""Tokenizer and chat template: from a GGUF's metadata or a Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2.sandbox
from tokenizers import Tokenizer

from specsplit.checkpoints.gguf_file import GGUFCheckpoint


class TextCodec:
    """Encodes prompts (optionally through the chat template) and decodes tokens."""

    def __init__(self, tokenizer_json: str, chat_template: str | None, bos_token: str = "",
                 eos_token: str = "") -> None:
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.template = None
        if chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self.template = env.from_string(chat_template)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> TextCodec | None:
        path = Path(path)
        if path.suffix == ".gguf":
            ck = GGUFCheckpoint(path)
            tokens = ck.meta("tokenizer.ggml.tokens")
            bos, eos = ck.meta("tokenizer.ggml.bos_token_id"), ck.meta("tokenizer.ggml.eos_token_id")
            return cls(ck.tokenizer_json(), ck.meta("tokenizer.chat_template"),
                       tokens[bos] if bos is not None else "", tokens[eos] if eos is not None else "")
        if not (path / "tokenizer.json").exists():
            return None
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        return cls((path / "tokenizer.json").read_text(), cfg.get("chat_template"),
                   str(cfg.get("bos_token") or ""), str(cfg.get("eos_token") or ""))

    def render_chat(self, user_text: str) -> str:
        messages = [{"role": "user", "content": user_text}]
        if self.template is None:
            return user_text
        return self.template.render(messages=messages, add_generation_prompt=True,
                                    bos_token=self.bos_token, eos_token=self.eos_token)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)
