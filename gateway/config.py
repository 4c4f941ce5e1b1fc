"""Gateway configuration, validated at start."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GatewayConfig:
    target_addr: str = "127.0.0.1:50061"
    draft_addr: str = "127.0.0.1:50062"  # empty: no draft, target-only decoding
    model: str = "smollm2"  # for the tokenizer and chat template (same spec as the target)
    host: str = "127.0.0.1"
    port: int = 50051
    default_num_steps: int = 4  # speculation on by default; 0 turns it off by default
    max_num_steps: int = 8
    default_max_new_tokens: int = 128
    max_new_tokens_cap: int = 4096
    max_prompt_chars: int = 1_000_000  # bound before tokenizing
    max_queue: int = 256  # requests waiting for a KV slot; beyond: RESOURCE_EXHAUSTED
    draft_retry_s: float = 2.0  # how often a lost draft or target is tried again
    step_timeout_s: float = 60.0  # a draft or target step slower than this counts as a failure

    def validate(self) -> GatewayConfig:
        if not self.target_addr:
            raise ValueError("target_addr is required")
        if not 0 <= self.default_num_steps <= self.max_num_steps:
            raise ValueError("default_num_steps must be within 0..max_num_steps")
        if self.default_max_new_tokens < 1 or self.default_max_new_tokens > self.max_new_tokens_cap:
            raise ValueError("default_max_new_tokens must be within 1..max_new_tokens_cap")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        return self
