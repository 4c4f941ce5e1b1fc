"""Head loading and the hidden-state mapping around the draft engine."""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from draft_service.config import DraftConfig
from draft_service.engine import DraftEngine
from draft_service.warmup import warm_up
from specsplit.checkpoints.eagle_head import load_head, resolve_head_dir
from specsplit.checkpoints.shapes import random_embedding, random_weights_spec
from specsplit.checkpoints.target_checkpoint import load_safetensors_dir, load_target_config, resolve_target_dir
from specsplit.forced import ForcedAcceptance
from specsplit.models.eagle3 import Eagle3Head
from specsplit.ops import DraftOp, DraftResult, StepTiming
from specsplit.transport.handoff import open_reader
from specsplit.transport.handoff.base import DTYPES, Descriptor

EMBED_KEY = "model.embed_tokens.weight"
WARM_TOPK = (1, 4)  # chains, and trees of SGLang's usual branching
log = logging.getLogger("specsplit.draft")


def build_head(cfg: DraftConfig) -> Eagle3Head:
    head_cfg, weights = load_head(resolve_head_dir(cfg.head, cfg.target))
    # the target's embedding, always (as SGLang's EAGLE worker does, even when the head ships a table)
    target_dir = resolve_target_dir(cfg.target)
    random_spec = random_weights_spec(target_dir)
    if random_spec is not None:  # a timing shape: a seeded random table
        embed = random_embedding(load_target_config(target_dir), int(random_spec["seed"]), random_spec["std"])
    else:
        embed = load_safetensors_dir(target_dir, only={EMBED_KEY})[EMBED_KEY]
    shipped = weights.pop("embed_tokens.weight", None)
    if shipped is not None and (shipped.shape != embed.shape or not torch.equal(shipped.to(embed.dtype), embed)):
        log.warning("the head ships its own embed_tokens, different from the target's: the target's is used")
    if embed.shape != (head_cfg.vocab_size, head_cfg.hidden_size):
        raise ValueError(f"target embedding {tuple(embed.shape)} does not fit the head "
                         f"(vocab {head_cfg.vocab_size}, hidden {head_cfg.hidden_size})")
    with torch.device(cfg.device):
        head = Eagle3Head(head_cfg)
    head.load_weights(weights, embed)
    return head.to(DTYPES[cfg.dtype]).eval()


class DraftRuntime:
    def __init__(self, cfg: DraftConfig, head: Eagle3Head | None = None) -> None:
        self.cfg = cfg
        self.head = head or build_head(cfg)
        self.engine = DraftEngine(self.head, cfg.max_sequences, cfg.max_context, cfg.max_steps, cfg.cuda_graphs,
                                  cfg.compile, cfg.max_topk, cfg.fused_head, cfg.ahead_slots,
                                  ForcedAcceptance.parse(cfg.benchmark_tree_profile))
        if self.engine.ranks:
            log.warning("benchmark mode: trees ranked by the profile %s, not by the head (specsplit.forced)",
                        cfg.benchmark_tree_profile)
        self.descriptor: Descriptor | None = None
        self.opens = 0  # hidden-store mappings opened: once per target, never per cycle
        self.warm_topk = cfg.warm_topk or list(WARM_TOPK)
        if cfg.warm_up:  # the kernels compile (the graphs are captured once the target attaches)
            with self._on_device():
                warm_up(self.engine, self.warm_topk, capture=False)

    def attach(self, desc: Descriptor) -> None:
        if desc == self.descriptor:
            return  # already mapped
        width = 3 * self.head.cfg.target_hidden_size
        if desc.width != width:
            raise ValueError(f"hidden store rows are {desc.width} wide, this head reads {width}")
        if self.engine.reader is not None:
            self.engine.runner.graphs.forget(reads_ring)  # their ring is gone with its reader
            self.engine.reader.close()
        self.engine.reader = open_reader(desc, self.cfg.device)
        self.descriptor = desc
        self.opens += 1

    def warm_graphs(self) -> int:
        """Once attached: capture the warm-up's graphs, reading the features where serving will
        (draft_service.warmup); how many shapes ran."""
        try:
            if not self.cfg.warm_up or self.engine.reader is None:
                return 0
            ring = self.engine.reader.ring_on(self.engine.device)
            with self._on_device():
                return warm_up(self.engine, self.warm_topk, capture=True, ring=ring)
        finally:
            self.engine.runner.graphs.serving = True  # a capture from now on holds up a step: logged

    def _on_device(self) -> contextlib.AbstractContextManager[object]:
        device = self.engine.device
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    def step(self, ops: list[DraftOp]) -> tuple[list[DraftResult], StepTiming]:
        t0 = time.perf_counter()
        results = self.engine.execute(ops)
        ms = (time.perf_counter() - t0) * 1e3
        return results, StepTiming(ms, ms)

    def hold(self, epoch: int) -> int:
        """Serve the lease `epoch` (0: none): release the sequences of any other; how many."""
        return self.engine.hold(epoch)

    def stats(self) -> dict[str, int]:
        seqs = len(self.engine.seqs)
        return {"active_sequences": seqs, "free_kv_slots": self.engine.max_sequences - seqs,
                "graphs_captured_while_serving": self.engine.runner.graphs.late_captures,
                "steps_past_graph_budget": self.engine.runner.graphs.over_budget,
                "graph_capture_ms_while_serving": round(self.engine.runner.graphs.late_capture_ms)}


def reads_ring(key: tuple[object, ...]) -> bool:
    """Whether a draft graph's key names a ring it reads its features from."""
    return any(isinstance(part, tuple) and part[:1] == ("ring",) for part in key)
