"""Gateway configuration, validated at start."""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.transport.step_socket import check_spin_us


@dataclass
class GatewayConfig:
    target_addr: str = "127.0.0.1:50061"
    draft_addr: str = "127.0.0.1:50062"  # empty: no draft, target-only decoding
    model: str = "smollm2"  # for the tokenizer and chat template (same spec as the target)
    host: str = "127.0.0.1"
    port: int = 50051
    default_num_steps: int = 4  # speculation on by default; 0 turns it off by default
    max_num_steps: int = 8
    default_topk: int = 1  # > 1: greedy requests draft a tree by default (sampled ones always draft a chain)
    max_topk: int = 8
    default_num_draft_tokens: int = 16  # a tree's size counting the root, unless a request says
    max_num_draft_tokens: int = 16  # at most the target's max_draft_tokens + 1
    default_max_new_tokens: int = 128
    max_new_tokens_cap: int = 4096
    max_prompt_chars: int = 1_000_000  # bound before tokenizing
    max_queue: int = 256  # requests waiting for a KV slot; beyond: RESOURCE_EXHAUSTED
    max_prompt_tokens: int = 0  # 0: the target's context window
    max_streams: int = 512  # concurrent Generate calls; beyond: RESOURCE_EXHAUSTED
    stream_interval: int = 1  # tokens gathered per streamed message after the first (SGLang's --stream-interval)
    tls_cert: str = ""  # PEM files: serve TLS on the public port
    tls_key: str = ""
    auth_token: str | None = None  # bearer token clients must send (from a file or SPECSPLIT_AUTH_TOKEN)
    draft_retry_s: float = 2.0  # how often a lost draft or target is tried again
    step_timeout_s: float = 60.0  # a draft or target step slower than this counts as a failure
    step_sockets: bool = True  # Steps over a service's Unix socket when it offers one on this host
    loop_thread: bool = True  # the speculation loop on a thread of its own (its step sockets read blocking)
    step_spin_us: float = -1.0  # loop thread: poll a step socket this long for the reply before blocking; -1: auto

    def validate(self) -> GatewayConfig:
        if not self.target_addr:
            raise ValueError("target_addr is required")
        if not 0 <= self.default_num_steps <= self.max_num_steps:
            raise ValueError("default_num_steps must be within 0..max_num_steps")
        if not 1 <= self.default_topk <= self.max_topk:
            raise ValueError("default_topk must be within 1..max_topk")
        if not 2 <= self.default_num_draft_tokens <= self.max_num_draft_tokens:
            raise ValueError("default_num_draft_tokens must be within 2..max_num_draft_tokens")
        if self.max_new_tokens_cap < 1 or self.default_max_new_tokens < 1:
            raise ValueError("max_new_tokens_cap and default_max_new_tokens must be >= 1")
        self.default_max_new_tokens = min(self.default_max_new_tokens, self.max_new_tokens_cap)
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if not 1 <= self.stream_interval <= 4096:
            raise ValueError("stream_interval must be within 1..4096")
        if not 0.0 < self.step_timeout_s <= 3600.0:
            raise ValueError("step_timeout_s must be within (0, 3600] seconds")
        check_spin_us(self.step_spin_us)
        if self.max_queue < 1 or self.max_streams < 1:
            raise ValueError("max_queue and max_streams must be >= 1")
        if self.max_prompt_tokens < 0 or self.max_prompt_chars < 1:
            raise ValueError("max_prompt_tokens must be >= 0 and max_prompt_chars >= 1")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both tls_cert and tls_key")
        return self
