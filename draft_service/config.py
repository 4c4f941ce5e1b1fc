"""Draft service configuration, validated at start."""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.transport.handoff.base import DTYPES
from specsplit.transport.step_socket import check_spin_us, check_step_socket


@dataclass
class DraftConfig:
    # an EAGLE-3 head directory, a shipped head's name (`smollm2-eagle3`), `default` (the shipped head trained
    # for the target, else random) or `random` (made for the target, cached)
    head: str = "default"
    target: str = "smollm2"  # the target model: the head borrows its embedding table
    dtype: str = "float32"
    device: str = "cpu"
    max_context: int = 2048
    max_sequences: int = 8
    max_steps: int = 8  # draft tokens proposed per cycle (a chain), or levels of a tree, at most
    max_topk: int = 8  # a tree's branching per expanded node, at most (KV room: max_steps * max_topk entries)
    host: str = "127.0.0.1"
    port: int = 50062
    threads: int = 0
    engine_thread: bool = True  # gRPC steps on a dedicated thread; False: on the event loop (the socket: its own)
    cuda_graphs: bool = True  # extend and proposal steps in CUDA graphs (on CUDA devices only)
    compile: bool = False  # experimental: fuse the static forward's kernels with torch.compile before capture
    step_socket: str = ""  # also serve Step on this Unix socket (same host gateways); "": gRPC only
    step_socket_spin_us: float = -1.0  # poll the step socket this long for the next request before blocking; -1: auto

    def validate(self) -> DraftConfig:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        for name in ("max_context", "max_sequences", "max_steps", "max_topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        check_step_socket(self.step_socket)
        check_spin_us(self.step_socket_spin_us)
        return self
