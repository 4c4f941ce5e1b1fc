"""Target service configuration: each field's flag, help and environment variable are
declared here (specsplit.flags builds the service's parser from them); validated at start."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specsplit.flags import flag

FUSED_DECODE = ("auto", "off", "on", "pdl")
SPIN_HELP = ("after each reply, poll the step socket this many µs for the next request before a blocking read (a core "
             "kept busy while serving, no wake-up from idle; 0: block at once; -1, the default: 20000 on CUDA, 0 on "
             "CPU)")
INLINE_HELP = ("run gRPC Step calls on the event loop thread instead of an engine thread (less latency per step; "
               "health checks wait while a step runs); the step socket always steps on its own connection thread")


@dataclass
class TargetConfig:
    model: str = flag("smollm2", "--model", "the target: a directory, a .gguf file, smollm2 (the embedded default) "
                      "or shape:NAME (random weights, timing only)",
                      env="SPECSPLIT_MODEL")
    dtype: str = flag("float32", "--dtype", "float32, bfloat16 or float16")
    device: str = flag("cpu", "--device", "torch device of rank 0")
    tp_size: int = flag(1, "--tp-size", "tensor-parallel ranks (spawned; under torchrun, WORLD_SIZE)")
    max_context: int = flag(2048, "--max-context", "tokens per sequence, drafts included")
    max_sequences: int = flag(8, "--max-sequences", "preallocated KV slots")
    max_draft_tokens: int = flag(16, "--max-draft-tokens", "draft tokens per verify")
    aux_layer_ids: list[int] | None = flag(None, "--aux-layer-ids", "comma-separated target layer ids to capture "
                                           "(default: the draft config's, else the EAGLE-3 default)")
    draft_config: str | None = flag(None, "--draft-config", "head config.json naming eagle_aux_hidden_state_layer_ids",
                                    env="SPECSPLIT_DRAFT_CONFIG")
    hidden_backend: str = flag("shm", "--hidden-backend", "hidden-state handoff: shm, cuda_ipc or inline")
    ring_rows: int = flag(0, "--ring-rows", "hidden-state ring capacity in rows (0: 2 * max-context)")
    host: str = flag("127.0.0.1", "--host", "address to serve on")
    port: int = flag(50061, "--port", "port to serve on")
    dist_port: int = flag(0, "--dist-port", "gloo/NCCL rendezvous port for tp-size > 1 (0: a free one)")
    threads: int = flag(0, "--threads", "torch intra-op threads per rank (0: torch's default)")
    engine_thread: bool = flag(True, "--inline-steps", INLINE_HELP)
    cuda_graphs: bool = flag(True, "--no-cuda-graphs", "run verify steps eagerly on CUDA (default: CUDA graphs per "
                             "shape bucket)")
    compile: bool = flag(False, "--compile", "experimental: fuse the kernels of the static verify/decode forward with "
                         "torch.compile (inductor) before the CUDA graphs capture it; compiles on first use of each "
                         "shape")
    fused_decode: str = flag("auto", "--fused-decode", "steps of up to 64 tokens (decodes, verifies of chains and "
                             "trees, batches of them) as the fused Triton step, five kernels a layer: auto (default) "
                             "wherever it runs (CUDA, tp 1, a model it supports; elsewhere the padded path; at tp > 1 "
                             "each rank runs it on its shard when asked with on or pdl), with "
                             "programmatic dependent launch where it pays (specsplit.models.fused.pdl_pays); on: "
                             "without it; pdl: with it at every step; off: the padded path",
                             choices=FUSED_DECODE)
    few_rows: int = flag(-1, "--few-rows", "fused steps of up to this many tokens in all (a chain's verify, a "
                         "batch of up to this many decodes, run unpadded; larger batches pad to a power of two) "
                         "compute every row as a one-token decode does, bit for bit: bf16 speculation and batching "
                         "then give the tokens decoding alone gives. Larger steps take the tensor-core tiles, "
                         "faster from 4 rows (H200) or by 8 (H100) at SmolLM2's size. 0 to 8; -1 (default): for "
                         "targets up to 2048 wide the GPU model's measured choice (4 on the H100, else 3), else 0")
    forced_acceptance: bool = flag(False, "--benchmark-forced-acceptance", "benchmark only: honour verifies that "
                                   "force how many drafts are accepted (the gateway's --benchmark-forced-acceptance); "
                                   "their output is not the model's")
    step_socket: str = flag("", "--step-socket", "also serve Step on this Unix socket, for a gateway on the same host "
                            "(default: gRPC only)", env="SPECSPLIT_TARGET_STEP_SOCKET")
    step_socket_spin_us: float = flag(-1.0, "--step-socket-spin-us", SPIN_HELP)

    def validate(self) -> TargetConfig:
        # torch comes with these: imported here, so that building a parser from this class stays light
        from specsplit.models.fused import FEW_ROWS_MAX
        from specsplit.transport.handoff.base import DTYPES
        from specsplit.transport.handoff.factory import BACKENDS
        from specsplit.transport.step_socket import check_spin_us, check_step_socket

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        if self.hidden_backend not in BACKENDS:
            raise ValueError(f"hidden_backend {self.hidden_backend!r} not in {BACKENDS}")
        for name in ("tp_size", "max_context", "max_sequences", "max_draft_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.ring_rows == 0:
            self.ring_rows = 2 * self.max_context
        if self.ring_rows < self.max_context:
            raise ValueError(f"ring_rows {self.ring_rows} must hold one full context ({self.max_context})")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.fused_decode not in FUSED_DECODE:
            raise ValueError(f"fused_decode {self.fused_decode!r} not in {FUSED_DECODE}")
        if self.fused_decode in ("on", "pdl") and not self.device.startswith("cuda"):
            raise ValueError("fused_decode needs a CUDA device")
        if not -1 <= self.few_rows <= FEW_ROWS_MAX:
            raise ValueError(f"few_rows {self.few_rows} not within -1 (the default) .. {FEW_ROWS_MAX}")
        check_step_socket(self.step_socket)
        check_spin_us(self.step_socket_spin_us)
        return self

    def resolve_aux_layer_ids(self, default: list[int]) -> list[int]:
        if self.aux_layer_ids is not None:
            return list(self.aux_layer_ids)
        if self.draft_config:
            cfg = json.loads(Path(self.draft_config).read_text())
            ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            if ids:
                return [int(i) for i in ids]
        return default
