"""Target service configuration, validated at start."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specsplit.transport.handoff.base import DTYPES
from specsplit.transport.handoff.factory import BACKENDS
from specsplit.transport.step_socket import check_spin_us, check_step_socket

FUSED_DECODE = ("off", "on", "pdl")


@dataclass
class TargetConfig:
    model: str = "smollm2"  # directory, .gguf file, or the embedded default
    dtype: str = "float32"
    device: str = "cpu"
    tp_size: int = 1
    max_context: int = 2048  # tokens per sequence, drafts included
    max_sequences: int = 8  # preallocated KV slots
    max_draft_tokens: int = 16  # per verify
    aux_layer_ids: list[int] | None = None  # None: the draft config's, or the EAGLE-3 default
    draft_config: str | None = None  # a head's config.json to read eagle_aux_hidden_state_layer_ids
    hidden_backend: str = "shm"
    ring_rows: int = 0  # 0: 2 * max_context
    host: str = "127.0.0.1"
    port: int = 50061
    dist_port: int = 0  # gloo/NCCL rendezvous port for tp_size > 1 (0: pick a free one)
    threads: int = 0  # torch intra-op threads per rank (0: torch's default)
    engine_thread: bool = True  # gRPC steps on a dedicated thread; False: on the event loop (the socket: its own)
    cuda_graphs: bool = True  # verify/decode steps in CUDA graphs (on CUDA devices only)
    compile: bool = False  # experimental: fuse the static forward's kernels with torch.compile before capture
    fused_decode: str = "off"  # steps of one sequence (decode, verify <= 64 tokens) in Triton kernels: off|on|pdl
    step_socket: str = ""  # also serve Step on this Unix socket (same host gateways); "": gRPC only
    step_socket_spin_us: float = -1.0  # poll the step socket this long for the next request before blocking; -1: auto

    def validate(self) -> TargetConfig:
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
        if self.fused_decode != "off" and (not self.device.startswith("cuda") or self.tp_size != 1):
            raise ValueError("fused_decode needs a CUDA device and tp_size 1")
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
