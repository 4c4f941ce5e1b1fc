"""CUDA graphs for static-shape functions, one per key, captured on first use.

A function of static shapes (the runner's padded forward, the fused step, the draft's tree
growth) is captured once per key, e.g. (batch bucket, tokens per sequence, context bucket);
later steps of that key copy their inputs into the graph's input buffers and replay it: one
launch instead of hundreds.
With graphs disabled (or off CUDA) the same function runs eagerly on the same shapes, so
the two modes compute the same kernels and give identical results. With `compile`, each
function is compiled whole for its key's shapes (torch.compile, inductor) before its graph
captures it: its elementwise work, norms and index arithmetic become a few generated kernels.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx.experimental._config

log = logging.getLogger("specsplit.graphs")

Outputs = tuple[torch.Tensor | None, ...]
StaticFn = Callable[..., Outputs]


def bucket_up(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= n, or None when n is above the largest."""
    return next((b for b in buckets if b >= n), None)


def pow2_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """smallest, 2*smallest, ... and `largest` itself as the last bucket."""
    out, b = [], smallest
    while b < largest:
        out.append(b)
        b *= 2
    return (*out, largest)


def batch_buckets(slots: int, exact: int = 0) -> tuple[int, ...]:
    """Batch sizes a step pads to: every size up to `exact` (capped at `slots`), then powers of
    two and `slots` itself."""
    return tuple(sorted({*range(1, min(exact, slots) + 1), *pow2_buckets(1, slots)}))


_paused = 0
_paused_lock = threading.Lock()
_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector held off (for every thread: captures on several engine threads
    nest): a graph dropped in a reference cycle is torn down when the collector frees it, and CUDA
    refuses that teardown while any stream captures, which invalidates the capture."""
    global _paused, _was_enabled
    with _paused_lock:
        if _paused == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _paused += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused -= 1
            if _paused == 0 and _was_enabled:
                gc.enable()


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: Outputs
    staging: dict[str, torch.Tensor]  # pinned host copies of the host inputs: their copies run asynchronously
    views: dict[str, np.ndarray]  # the same buffers as arrays, which the host fills in place
    staged: torch.cuda.Event  # after the last copies out of `staging`


HostInput = torch.Tensor | np.ndarray


class GraphCache:
    """Captured graphs by key. `run(key, fn, **inputs)` returns fn's outputs: the graph's
    static output tensors, valid until the next run of the same key. Inputs may be host
    tensors or arrays: each is placed on the cache's device by one copy (into the graph's input
    buffer when replaying), so callers need not move them first. A host input goes through a
    pinned buffer of its graph, filled in place: a copy from pageable memory would block the
    host until the device has it, a pinned one is queued before the replay like a kernel."""

    def __init__(self, device: torch.device, enabled: bool = True, max_graphs: int = 2048,
                 compile: bool = False) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.compile = compile and self.enabled
        if self.compile:  # one compiled variant per key: the graphed functions' code is shared by many keys
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, max_graphs)
        self.device, self.max_graphs = device, max_graphs
        self.graphs: dict[tuple[object, ...], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        # torch.cuda.graph's default capture stream is made once per process, on whichever GPU was
        # current then: engines on other GPUs of the same process need their own
        self.capture_stream = torch.cuda.Stream(device) if self.enabled else None
        self.replays = 0
        self.refused: set[object] = set()  # kinds of keys (their first item) whose capture failed here: run eagerly
        self.last: torch.cuda.CUDAGraph | None = None  # the graph replayed last (benchmarks time it alone)
        # set once the engine's warm-up is done: a capture after it held up a step, and is logged
        self.serving = False
        self.late_captures = 0  # captures while serving
        self.late_capture_ms = 0.0  # what they held up the steps for (a first use's compile included)
        self.over_budget = 0  # steps run eagerly for want of room for their graph

    def run(self, key: tuple[object, ...], fn: StaticFn, **inputs: HostInput) -> Outputs:
        if not self.enabled:
            return self.eager(fn, **inputs)
        if self.device.index is None or torch.cuda.current_device() == self.device.index:  # (engine threads are)
            return self._run(key, fn, inputs)
        # capture and replay on this cache's GPU, whatever the caller's current device (graphs are per device)
        with torch.cuda.device(self.device):
            return self._run(key, fn, inputs)

    def eager(self, fn: StaticFn, **inputs: HostInput) -> Outputs:
        """fn(**inputs) run eagerly, its inputs placed on the cache's device."""
        return fn(**{name: _tensor(x).to(self.device) for name, x in inputs.items()})

    def _run(self, key: tuple[object, ...], fn: StaticFn, inputs: dict[str, HostInput]) -> Outputs:
        captured = self.graphs.get(key)
        if captured is None:
            if len(self.graphs) >= self.max_graphs:  # shapes beyond the budget run eagerly
                if not self.over_budget:
                    log.warning("%d CUDA graphs held: shapes not captured by now run eagerly, %s first",
                                self.max_graphs, key)
                self.over_budget += 1
                return self.eager(fn, **inputs)
            captured = self.graphs[key] = self._capture(key, fn, {name: _tensor(x) for name, x in inputs.items()})
        else:
            captured.staged.synchronize()  # the last replay's copies out of the staging buffers are done
            for name, x in inputs.items():
                view = captured.views.get(name)
                if view is not None:  # a host input: into its pinned buffer, then to the device without blocking
                    np.copyto(view, x if isinstance(x, np.ndarray) else x.numpy())
                    captured.inputs[name].copy_(captured.staging[name], non_blocking=True)
                else:
                    captured.inputs[name].copy_(x, non_blocking=True)
            captured.staged.record()
        captured.graph.replay()
        self.replays += 1
        self.last = captured.graph
        return captured.outputs

    def forget(self, stale: Callable[[tuple[object, ...]], bool]) -> int:
        """Drop the graphs whose key is `stale` (e.g. those reading a hidden-state ring that is
        gone); how many."""
        keys = [key for key in self.graphs if stale(key)]
        for key in keys:
            del self.graphs[key]
        self.last = None
        return len(keys)

    def _capture(self, key: tuple[object, ...], fn: StaticFn, inputs: dict[str, torch.Tensor]) -> _Captured:
        t0 = time.perf_counter()
        captured = self._record(key, fn, inputs)
        ms = (time.perf_counter() - t0) * 1e3
        if self.serving:
            self.late_captures += 1
            self.late_capture_ms += ms
            log.info("captured the graph of %s at its first use while serving: %.1f ms", key, ms)
        else:
            log.debug("captured the graph of %s: %.1f ms", key, ms)
        return captured

    def _record(self, key: tuple[object, ...], fn: StaticFn, inputs: dict[str, torch.Tensor]) -> _Captured:
        if self.compile:
            log.info("compiling the graph of %s (its first use)", key)
            fn = torch.compile(fn, dynamic=False)
        static = {name: x.to(self.device, copy=True) for name, x in inputs.items()}
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: lazy initialisation (cuBLAS handles, workspaces) off the graph
            for _ in range(2):
                fn(**static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
            outputs = fn(**static)
        staging = {name: torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for name, x in inputs.items()
                   if x.device.type == "cpu"}
        staged = torch.cuda.Event()
        staged.record()
        return _Captured(graph, static, outputs, staging, {name: x.numpy() for name, x in staging.items()}, staged)


def _tensor(x: HostInput) -> torch.Tensor:
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


RECOMPILE_LIMIT = 64  # variants of one compiled function: runners (target, draft) x capture x masks x inputs


def compile_static(fn: Callable[..., tuple]) -> Callable[..., tuple]:
    """torch.compile (inductor) of a static-shape forward: norms, rotary, SiLU·mul, residual adds
    and the KV index ops fused into a few generated kernels per layer. Shapes are symbolic (one
    compile serves many buckets); no duck sizing, so a batch that happens to equal the KV-head
    count does not force a recompile. Each runner of a process compiles the same method, once
    per combination of its inputs' kinds (capture, tree mask or visibility, hidden width):
    more than dynamo's default limit of 8."""
    torch.fx.experimental._config.use_duck_shape = False
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=True, fullgraph=True)
