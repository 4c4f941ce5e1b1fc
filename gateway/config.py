"""Gateway configuration: each field's flag, help and environment variable are declared
here (specsplit.flags builds the gateway's parser from them); validated at start."""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.flags import flag

STEP_TIMEOUT_HELP = ("seconds: a draft step slower than this suspends speculation (streams go on target-only), a "
                     "target step slower than this ends the streams with UNAVAILABLE")
SPIN_HELP = ("with the loop thread: poll a step socket this many µs for the reply before a blocking read (no wake-up "
             "from idle when the reply comes; 0: block at once; -1, the default: 20000 when the target hands hidden "
             "states over CUDA IPC, else 0)")


@dataclass
class GatewayConfig:
    target_addr: str = flag("127.0.0.1:50061", "--target", "target service address", env="SPECSPLIT_TARGET_ADDR")
    draft_addr: str = flag("127.0.0.1:50062", "--draft", "draft service address; empty for target-only decoding",
                           env="SPECSPLIT_DRAFT_ADDR")
    model: str = flag("smollm2", "--model", "the target model, for the tokenizer and chat template: the target's "
                      "spec", env="SPECSPLIT_MODEL")
    host: str = flag("127.0.0.1", "--host", "address to serve on")
    port: int = flag(50051, "--port", "port to serve on")
    default_num_steps: int = flag(4, "--num-steps", "default draft steps per cycle (0: speculation off by default)")
    max_num_steps: int = flag(8, "--max-num-steps", "most draft steps per cycle a request may ask for")
    default_topk: int = flag(1, "--topk", "default tree branching for greedy requests (1: chain drafts; sampled "
                             "requests always draft a chain)")
    max_topk: int = flag(8, "--max-topk", "widest tree branching a request may ask for")
    default_num_draft_tokens: int = flag(16, "--num-draft-tokens", "default tree size counting the root (trees only)")
    max_num_draft_tokens: int = flag(16, "--max-num-draft-tokens", "largest tree a request may ask for (at most the "
                                     "target's max-draft-tokens + 1)")
    default_max_new_tokens: int = flag(128, "--max-new-tokens", "default max_new_tokens (lowered to the cap)")
    max_new_tokens_cap: int = flag(4096, "--max-new-tokens-cap", "largest max_new_tokens a request may ask for")
    max_prompt_chars: int = flag(1_000_000, "--max-prompt-chars", "longest prompt text, bounded before tokenizing")
    max_queue: int = flag(256, "--max-queue", "requests waiting for a KV slot; beyond: RESOURCE_EXHAUSTED")
    max_prompt_tokens: int = flag(0, "--max-prompt-tokens", "longest prompt in tokens (0: the target's context window)")
    max_streams: int = flag(512, "--max-streams", "concurrent Generate calls; beyond: RESOURCE_EXHAUSTED")
    stream_interval: int = flag(1, "--stream-interval", "tokens gathered per streamed message after the first one "
                                "(1: every cycle's tokens at once)")
    tls_cert: str = flag("", "--tls-cert", "PEM certificate: serve TLS on the public port", env="SPECSPLIT_TLS_CERT")
    tls_key: str = flag("", "--tls-key", "PEM private key of --tls-cert", env="SPECSPLIT_TLS_KEY")
    auth_token: str | None = flag(None, "--auth-token-file", "file holding the bearer token clients must send",
                                  env="SPECSPLIT_AUTH_TOKEN", secret=True)
    draft_retry_s: float = flag(2.0, "--draft-retry", "seconds between attempts to reach a lost draft or target")
    step_timeout_s: float = flag(60.0, "--step-timeout", STEP_TIMEOUT_HELP)
    step_sockets: bool = flag(True, "--no-step-sockets", "always send Steps over the gRPC streams, even where a "
                              "service offers a Unix step socket")
    loop_thread: bool = flag(True, "--no-loop-thread", "run the speculation loop on the server's event loop instead "
                             "of a thread of its own (whose step sockets are read blocking)")
    step_spin_us: float = flag(-1.0, "--step-spin-us", SPIN_HELP)

    def validate(self) -> GatewayConfig:
        from specsplit.transport.step_socket import check_spin_us  # torch comes with it: imported when validating

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
        if not 0.0 < self.draft_retry_s <= 3600.0:
            raise ValueError("draft_retry_s must be within (0, 3600] seconds")
        check_spin_us(self.step_spin_us)
        if self.max_queue < 1 or self.max_streams < 1:
            raise ValueError("max_queue and max_streams must be >= 1")
        if self.max_prompt_tokens < 0 or self.max_prompt_chars < 1:
            raise ValueError("max_prompt_tokens must be >= 0 and max_prompt_chars >= 1")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both tls_cert and tls_key")
        return self
