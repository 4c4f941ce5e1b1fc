"""Draft service configuration: each field's flag, help and environment variable are
declared here (specsplit.flags builds the service's parser from them); validated at start."""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.flags import flag
from specsplit.forced import ForcedAcceptance

SPIN_HELP = ("after each reply, poll the step socket this many µs for the next request before a blocking read (a core "
             "kept busy while serving, no wake-up from idle; 0: block at once; -1, the default: 20000 on CUDA, 0 on "
             "CPU)")
FUSED_HEAD = ("auto", "on", "off")
INLINE_HELP = ("run gRPC Step calls on the event loop thread instead of an engine thread (less latency per step; "
               "health checks wait while a step runs); the step socket always steps on its own connection thread")


@dataclass
class DraftConfig:
    head: str = flag("default", "--head", "the EAGLE-3 head: a directory, a shipped head's name (smollm2-eagle3), "
                     "default (the shipped head trained for the target, else random) or random (made for the "
                     "target, cached)", env="SPECSPLIT_HEAD")
    target: str = flag("smollm2", "--target", "the target model: the head borrows its embedding table",
                       env="SPECSPLIT_MODEL")
    dtype: str = flag("float32", "--dtype", "float32, bfloat16 or float16")
    device: str = flag("cpu", "--device", "torch device")
    max_context: int = flag(2048, "--max-context", "tokens per sequence")
    max_sequences: int = flag(8, "--max-sequences", "preallocated KV slots")
    max_steps: int = flag(8, "--max-steps", "draft tokens proposed per cycle (a chain), or levels of a tree, at most")
    ahead_slots: int = flag(8, "--ahead-slots", "KV slots for drafting ahead: each holds one more outcome of a verify "
                            "than the whole path accepted, proposed for (0: that one only)")
    max_topk: int = flag(8, "--max-topk", "widest tree branching proposed (KV room: max-steps * max-topk entries)")
    host: str = flag("127.0.0.1", "--host", "address to serve on")
    port: int = flag(50062, "--port", "port to serve on")
    threads: int = flag(0, "--threads", "torch intra-op threads (0: torch's default)")
    engine_thread: bool = flag(True, "--inline-steps", INLINE_HELP)
    cuda_graphs: bool = flag(True, "--no-cuda-graphs", "run the head eagerly on CUDA (default: CUDA graphs per shape "
                             "bucket)")
    compile: bool = flag(False, "--compile", "experimental: compile each cycle's CUDA graph whole with torch.compile "
                         "(inductor) before capturing it (without CUDA graphs: the head's padded forward); the "
                         "first cycle of each new shape compiles (seconds to tens of seconds)")
    warm_up: bool = flag(True, "--no-warm-up", "on the GPU, run every shape of a one-sequence batch (each extend "
                         "bucket, every depth, each branching of --warm-topk) before serving: eagerly at start, which "
                         "compiles the kernels, then from graphs once the target attaches (default: on; off, a "
                         "request meeting a new shape waits for its compile and capture)")
    warm_topk: list[int] | None = flag(None, "--warm-topk", "tree branchings the warm-up runs, comma-separated "
                                       "(default: 1,4: chains and trees of 4)")
    fused_head: str = flag("auto", "--fused-head", "the head's steps of up to 64 tokens (extends, chain and tree "
                           "levels) and each tree level's bookkeeping as fused Triton kernels: auto (default) wherever "
                           "they run (CUDA, tensor parallelism 1, a head they support, without --compile; elsewhere "
                           "the padded path), on (refuse to start where they do not), off (the padded path)",
                           choices=FUSED_HEAD)
    step_socket: str = flag("", "--step-socket", "also serve Step on this Unix socket, for a gateway on the same host "
                            "(default: gRPC only)", env="SPECSPLIT_DRAFT_STEP_SOCKET")
    step_socket_spin_us: float = flag(-1.0, "--step-socket-spin-us", SPIN_HELP)
    benchmark_tree_profile: str = flag("", "--benchmark-tree-profile", "benchmark only, beside forced acceptance (a "
                                       "head without trained weights): rank each tree's candidates by this "
                                       "acceptance profile, 'shipped' or comma-separated rates of depths 1, 2, ..., "
                                       "instead of the head's probabilities, so that its trees are as deep as a "
                                       "trained head's (specsplit.forced)")

    def validate(self) -> DraftConfig:
        # torch comes with these: imported here, so that building a parser from this class stays light
        from specsplit.transport.handoff.base import DTYPES
        from specsplit.transport.step_socket import check_spin_us, check_step_socket

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        if not 0 <= self.ahead_slots <= 256:
            raise ValueError("ahead_slots must be within 0..256")
        for name in ("max_context", "max_sequences", "max_steps", "max_topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.warm_topk is not None and not all(1 <= k <= self.max_topk for k in self.warm_topk):
            raise ValueError(f"warm_topk {self.warm_topk} must lie within 1..max_topk ({self.max_topk})")
        if self.fused_head not in FUSED_HEAD:
            raise ValueError(f"fused_head {self.fused_head!r} not in {FUSED_HEAD}")
        if self.fused_head == "on" and not self.device.startswith("cuda"):
            raise ValueError("fused_head on needs a CUDA device")
        if self.fused_head == "on" and self.compile:
            raise ValueError("fused_head on and compile exclude each other: the compiled graphs run the padded path")
        ForcedAcceptance.parse(self.benchmark_tree_profile)
        check_step_socket(self.step_socket)
        check_spin_us(self.step_socket_spin_us)
        return self
