"""Tokenizer and chat template: from a GGUF's metadata or a Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:
    from specsplit.checkpoints.gguf_file import GGUFCheckpoint

_CONTROL = 3  # llama.cpp token type of special tokens


def gguf_tokenizer_json(ckpt: GGUFCheckpoint) -> str:
    """Build a byte-level BPE tokenizer (GPT-2 style, as SmolLM2 and Llama 3 use)."""
    if ckpt.meta("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {ckpt.meta('tokenizer.ggml.model')!r}")
    tokens: list[str] = list(ckpt.meta("tokenizer.ggml.tokens"))
    types = list(ckpt.meta("tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in ckpt.meta("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if ckpt.meta("tokenizer.ggml.pre") == "smollm":  # digits split one by one, then GPT-2 regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL])
    return tok.to_str()


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
            from specsplit.checkpoints.gguf_file import GGUFCheckpoint

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
