"""Model loading, tensor-parallel ranks and the hidden-state ring around the engine."""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch
import torch.distributed as dist

from specsplit.checkpoints.shapes import init_random_, random_weights_spec
from specsplit.checkpoints.target_checkpoint import (
    load_safetensors_dir,
    load_target_config,
    resolve_target_dir,
)
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import TensorParallel
from specsplit.ops import HiddenRef, StepTiming, TargetOp, TargetResult
from specsplit.transport.handoff import open_writer
from specsplit.transport.handoff.base import DTYPES, Allocation
from target_service.config import TargetConfig
from target_service.engine import Outcome, Plan, TargetEngine
from target_service.warmup import warm_up

_STOP = "stop"
log = logging.getLogger("specsplit.target")


def rank_device(device: str, rank: int) -> torch.device:
    """The device of `rank`: `cuda:K` (plain `cuda`: K = 0) puts rank r on GPU K + r; other devices are shared."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def build_model(cfg: TargetConfig, tp: TensorParallel) -> LlamaModel:
    model_dir = resolve_target_dir(cfg.model)
    mcfg = load_target_config(model_dir)
    if cfg.max_context > mcfg.max_position:
        raise ValueError(f"max_context {cfg.max_context} exceeds the model's {mcfg.max_position} positions")
    aux = cfg.resolve_aux_layer_ids(mcfg.default_aux_layer_ids())
    with torch.device(rank_device(cfg.device, tp.rank)):
        model = LlamaModel(mcfg, tp, aux).to(DTYPES[cfg.dtype])
    random_spec = random_weights_spec(model_dir)
    if random_spec is not None:  # a timing shape: each rank draws its own shard
        init_random_(model, int(random_spec["seed"]) + tp.rank, random_spec["std"])
    else:
        model.load_full_weights(load_safetensors_dir(model_dir))
    return model.eval()


class TargetRuntime:
    """Rank 0's view: turn one batched request into a plan, run it on every rank,
    write the captured features into the ring and answer."""

    def __init__(self, cfg: TargetConfig, tp: TensorParallel, model: LlamaModel | None = None) -> None:
        self.cfg, self.tp = cfg, tp
        self.device = rank_device(cfg.device, tp.rank)
        self.model = model or build_model(cfg, tp)
        self.engine = TargetEngine(cfg, self.model)
        self.writer = None
        if tp.rank == 0:
            width = 3 * self.model.cfg.hidden_size
            self.writer = open_writer(cfg.hidden_backend, cfg.ring_rows, width, DTYPES[cfg.dtype], self.device)
            self.engine.write_ring(self.writer.ring_on(self.device))
        if self.engine.runner.fused is not None:
            t0 = time.perf_counter()
            try:
                with self._on_device():
                    warm_up(self.engine)
            except Exception as e:  # noqa: BLE001 - e.g. Triton finds no C compiler for its launcher
                if cfg.fused_decode != "auto":
                    raise
                log.warning("the fused step's kernels do not compile here (%s: %s): the padded path serves",
                            type(e).__name__, e)
                self.engine.runner.fused = None
                self.engine.runner.graphs.graphs.clear()
            else:
                log.info("fused step's kernels compiled and its shapes captured in %.1f s", time.perf_counter() - t0)
        self.engine.runner.graphs.serving = True  # a capture from now on holds up a step: logged

    def _on_device(self) -> contextlib.AbstractContextManager[object]:
        # the current CUDA device is per thread and steps run on the server's engine thread:
        # NCCL's broadcast_object_list (and anything else that takes the current device) must find this rank's GPU
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def step(self, ops: list[TargetOp], release_generations: list[int]) -> tuple[list[TargetResult], StepTiming]:
        with self._on_device():
            return self._step(ops, release_generations)

    def _step(self, ops: list[TargetOp], release_generations: list[int]) -> tuple[list[TargetResult], StepTiming]:
        assert self.writer is not None, "only rank 0 serves steps"
        t0 = time.perf_counter()
        for g in release_generations:
            self.writer.release(g)
        allocs: list[Allocation | None] = []
        allowed: list[bool] = []
        for op in ops:
            n = self.engine.rows_needed(op)
            alloc = self.writer.allocate(n) if n else None
            allocs.append(alloc)
            allowed.append(n == 0 or alloc is not None)
        plan = Plan(ops, allowed, ring_rows=[-1 if alloc is None else alloc.offset for alloc in allocs])
        if self.tp.world_size > 1:
            dist.broadcast_object_list([plan], src=0)
        outcomes = self.engine.execute(plan)
        written: list[tuple[Outcome, Allocation, int]] = []  # the step's features
        rest: list[tuple[Allocation, torch.Tensor]] = []  # those the step did not write into the ring, written at once
        for outcome, alloc in zip(outcomes, allocs, strict=True):
            if alloc is None:
                continue
            n = outcome.feature_rows
            if n and outcome.result.code == 0:
                written.append((outcome, alloc, n))
                if outcome.rows is not None:
                    rest.append((alloc, outcome.rows))
            else:
                self.writer.release(alloc.generation)
        if rest:
            self.writer.write_all(rest)
        for outcome, alloc, n in written:  # alloc.inline: what the inline backend wrote
            outcome.result.hidden = HiddenRef(alloc.offset, n, alloc.generation, alloc.inline)
        results = [outcome.result for outcome in outcomes]
        ms = (time.perf_counter() - t0) * 1e3
        return results, StepTiming(compute_ms=ms, total_ms=ms)

    def hold(self, epoch: int) -> int:
        """Serve the lease `epoch` (0: none): on every rank, release the sequences of any other;
        the whole ring comes back (its rows belonged to them). Returns how many were released."""
        assert self.writer is not None, "only rank 0 serves leases"
        with self._on_device():
            before = len(self.engine.seqs)
            plan = Plan([], epoch=epoch)
            if self.tp.world_size > 1:
                dist.broadcast_object_list([plan], src=0)
            self.engine.execute(plan)
            self.writer.allocator.release_all()
            return before - len(self.engine.seqs)

    def stats(self) -> dict[str, int]:
        assert self.writer is not None
        return {"active_sequences": len(self.engine.seqs), "free_kv_slots": self.engine.runner.free_slots,
                "ring_rows_in_use": self.writer.allocator.used,
                "ring_live_allocations": self.writer.allocator.live_allocations,
                "graphs_captured_while_serving": self.engine.runner.graphs.late_captures,
                "steps_past_graph_budget": self.engine.runner.graphs.over_budget,
                "graph_capture_ms_while_serving": round(self.engine.runner.graphs.late_capture_ms)}

    def close(self) -> None:
        with self._on_device():
            if self.tp.world_size > 1:
                dist.broadcast_object_list([_STOP], src=0)
            if self.writer is not None:
                self.writer.close()


def init_distributed(rank: int, world_size: int, port: int, device: str) -> TensorParallel:
    """Join the rank group. On CUDA this rank's GPU (see rank_device) becomes the current
    device first, so NCCL and broadcast_object_list work on it."""
    dev = rank_device(device, rank)
    if dev.type == "cuda":
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"rank {rank} of {world_size} on --device {device} needs {dev}, but only "
                             f"{torch.cuda.device_count()} CUDA devices are visible")
        torch.cuda.set_device(dev)
    if world_size > 1:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        bind = {"device_id": dev} if backend == "nccl" else {}
        if "MASTER_ADDR" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
            dist.init_process_group(backend, **bind)  # started by torchrun
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                    **bind)
    return TensorParallel(rank, world_size)


def worker_loop(cfg: TargetConfig, rank: int) -> None:
    """Ranks 1..N-1: execute every plan rank 0 broadcasts, until told to stop."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tp = init_distributed(rank, cfg.tp_size, cfg.dist_port, cfg.device)
    engine = TargetEngine(cfg, build_model(cfg, tp))
    dist.barrier()
    while True:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] == _STOP:
            break
        engine.execute(box[0])  # type: ignore[arg-type]
    dist.destroy_process_group()
