"""Gateway configuration: each field's flag, help and environment variable are declared
here (specsplit.flags builds the gateway's parser from them); validated at start."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specsplit.checkpoints import EMBEDDED_DEFAULT, EMBEDDED_NAME
from specsplit.flags import flag
from specsplit.forced import ForcedAcceptance
from specsplit.placement import DRAFT_AHEAD

STEP_TIMEOUT_HELP = "seconds: a target step slower than this ends the streams with UNAVAILABLE"
DRAFT_TIMEOUT_HELP = ("seconds: the longest a draft step may take (a slower one suspends speculation, streams go on "
                      "target-only); once its steps are measured, a cycle's draft step gets 10 x their p99, at least "
                      "0.05 s, at most this")
LIVENESS_HELP = ("seconds: a target or draft that does not answer a heartbeat within this long is lost, idle or not "
                 "(the target: streams end with UNAVAILABLE; the draft: streams go on target-only)")
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
    served_model_name: str = flag("", "--served-model-name", "the model's name to clients (ModelInfo, SGLang's "
                                  "served_model_name, the id smg lists); default: SmolLM2-135M-Instruct for the "
                                  "embedded model, else the name of --model's directory or file",
                                  env="SPECSPLIT_SERVED_MODEL_NAME")
    host: str = flag("127.0.0.1", "--host", "address to serve on")
    port: int = flag(50051, "--port", "port to serve on")
    default_num_steps: int = flag(4, "--num-steps", "default draft steps per cycle (0: speculation off by default)")
    max_num_steps: int = flag(8, "--max-num-steps", "most draft steps per cycle a request may ask for")
    adaptive_steps: bool = flag(True, "--no-adaptive-steps", "draft the default shape every cycle: no choice per "
                                "cycle for greedy requests that leave num_steps unset (gateway.adaptive)")
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
    max_queued_per_client: int = flag(64, "--max-queued-per-client", "requests of one client waiting for a KV slot; "
                                      "beyond: RESOURCE_EXHAUSTED (a client: its bearer token, else its address)")
    max_prompt_tokens: int = flag(0, "--max-prompt-tokens", "longest prompt in tokens (0: the target's context window)")
    max_streams: int = flag(512, "--max-streams", "concurrent Generate calls; beyond: RESOURCE_EXHAUSTED")
    max_streams_per_client: int = flag(128, "--max-streams-per-client", "concurrent Generate calls of one client; "
                                       "beyond: RESOURCE_EXHAUSTED")
    stream_buffer: int = flag(1024, "--stream-buffer", "tokens a client may leave unread before its sequence waits "
                              "for it (keeping its KV slot)")
    unread_timeout_s: float = flag(30.0, "--unread-timeout", "seconds a sequence may wait for its client to read; "
                                   "then its stream ends with RESOURCE_EXHAUSTED")
    stream_interval: int = flag(1, "--stream-interval", "tokens gathered per streamed message after the first one "
                                "(1: every cycle's tokens at once)")
    tls_cert: str = flag("", "--tls-cert", "PEM certificate: serve TLS on the public port", env="SPECSPLIT_TLS_CERT")
    tls_key: str = flag("", "--tls-key", "PEM private key of --tls-cert", env="SPECSPLIT_TLS_KEY")
    auth_token: str | None = flag(None, "--auth-token-file", "file holding the bearer token clients must send",
                                  env="SPECSPLIT_AUTH_TOKEN", secret=True)
    draft_retry_s: float = flag(2.0, "--draft-retry", "seconds between attempts to reach a lost draft or target")
    step_timeout_s: float = flag(30.0, "--step-timeout", STEP_TIMEOUT_HELP, env="SPECSPLIT_STEP_TIMEOUT")
    draft_timeout_s: float = flag(5.0, "--draft-timeout", DRAFT_TIMEOUT_HELP, env="SPECSPLIT_DRAFT_TIMEOUT")
    liveness_timeout_s: float = flag(1.0, "--liveness-timeout", LIVENESS_HELP, env="SPECSPLIT_LIVENESS_TIMEOUT")
    lease_s: float = flag(10.0, "--lease", "seconds after the gateway's last heartbeat at which a service releases "
                          "the gateway's state by itself", env="SPECSPLIT_LEASE")
    shutdown_grace_s: float = flag(5.0, "--shutdown-grace", "seconds a stopping gateway lets streams in flight "
                                   "finish before it ends them with UNAVAILABLE", env="SPECSPLIT_SHUTDOWN_GRACE")
    forced_acceptance: str = flag("", "--benchmark-forced-acceptance", "benchmark only: each verify accepts a number "
                                  "of drafts drawn from this per-depth profile ('shipped': the shipped head's, or "
                                  "comma-separated rates of depths 1, 2, ...), the target started with the flag of the "
                                  "same name; the output is not the model's (specsplit.forced)")
    decode_ahead_ms: float = flag(8.0, "--decode-ahead-ms", "a cycle that drafts nothing (speculation off, or not "
                                  "paying), with no waiting request a free slot could take, decodes as many tokens "
                                  "in one target call as its measured cost a token fits in this many ms (a power of "
                                  "two, at most the target's max draft tokens + 1); 0: one token a call")
    prefill_chunk: int = flag(2048, "--prefill-chunk", "prompt tokens one target call prefills, over all its "
                              "newcomers: a longer prompt is prefilled in parts over several calls, so that the "
                              "running sequences go on between them (0: every prompt whole in one call)")
    draft_ahead: str = flag("auto", "--draft-ahead", "propose greedy sequences' next drafts while the target "
                            "verifies (gateway.ahead); auto: on when the draft computes on a GPU of its own",
                            choices=DRAFT_AHEAD)
    step_sockets: bool = flag(True, "--no-step-sockets", "always send Steps over the gRPC streams, even where a "
                              "service offers a Unix step socket")
    loop_thread: bool = flag(True, "--no-loop-thread", "run the speculation loop on the server's event loop instead "
                             "of a thread of its own (whose step sockets are read blocking)")
    step_spin_us: float = flag(-1.0, "--step-spin-us", SPIN_HELP)

    def served_name(self) -> str:
        """The name clients see: --served-model-name, else a conventional id from --model."""
        if self.served_model_name:
            return self.served_model_name
        if self.model == EMBEDDED_DEFAULT:
            return EMBEDDED_NAME
        return Path(self.model.rstrip("/")).stem or self.model

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
        for name in ("draft_retry_s", "draft_timeout_s", "liveness_timeout_s", "lease_s", "unread_timeout_s"):
            if not 0.0 < getattr(self, name) <= 3600.0:
                raise ValueError(f"{name} must be within (0, 3600] seconds")
        if not 0.0 <= self.decode_ahead_ms <= 1000.0:
            raise ValueError("decode_ahead_ms must be within [0, 1000] ms")
        if self.prefill_chunk < 0:
            raise ValueError("prefill_chunk must be >= 0")
        if not 0.0 <= self.shutdown_grace_s <= 3600.0:
            raise ValueError("shutdown_grace_s must be within [0, 3600] seconds")
        if self.lease_s < 2 * self.liveness_timeout_s:
            raise ValueError("lease_s must be at least twice liveness_timeout_s (a lease must outlive a heartbeat)")
        check_spin_us(self.step_spin_us)
        ForcedAcceptance.parse(self.forced_acceptance)
        for name in ("max_queue", "max_streams", "max_queued_per_client", "max_streams_per_client", "stream_buffer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_prompt_tokens < 0 or self.max_prompt_chars < 1:
            raise ValueError("max_prompt_tokens must be >= 0 and max_prompt_chars >= 1")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both tls_cert and tls_key")
        return self
