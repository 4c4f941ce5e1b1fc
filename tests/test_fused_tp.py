"""Tensor parallelism on GPUs and the fused steps under it (specsplit.models.fused): N ranks,
each running the fused kernels (or the padded path) on its shard with an all-reduce after the o
and down projections, decode the greedy tokens of the one-rank padded path in fp32 with its
logits and features to rounding, and verify a chain (a few rows) and a tree to the same. Shapes: SmolLM2's head layout
(9 heads / 3 KV heads: an uneven split on 2 ranks, KV heads copied on 4 and 8) and the
Llama-3.1-8B shape's layers. On N GPUs over NCCL (skipped below N); the fused step also on the
CPU over gloo under the Triton interpreter (TRITON_INTERPRET=1, small shapes only)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.ranks import spawn_ranks
from specsplit.checkpoints.shapes import SHAPES
from specsplit.cli.client import make_request
from specsplit.cli.launcher import StackConfig
from specsplit.models.batch import Batch, tree_layout
from specsplit.models.config import LlamaConfig
from specsplit.models.llama import LlamaModel, random_llama_weights
from specsplit.models.parallel import TensorParallel
from target_service.runtime import rank_device
from tests.test_tp import run_stack

INTERPRETED = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = [] if INTERPRETED else [pytest.mark.gpu]

SMALL = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=2, hidden_size=96, intermediate_size=192,
                            head_dim=32, vocab_size=500)  # 9 heads / 3 KV heads
SHAPED = {"smollm2": dataclasses.replace(SHAPES["smollm2-135m"], num_layers=3, vocab_size=4096),
          "llama-8b": dataclasses.replace(SHAPES["llama-3.1-8b"], num_layers=2, vocab_size=4096)}
TREE = [-1, 0, 0, 0, 0, 1, 1, 2, 3, 4, 5, 5, 6, 7, 10, 11]  # SGLang's topk 4 / 16 drafts shape
CHAIN = [-1, 0, 1, 2]
PROMPT, DECODES, CONTEXT = 40, 6, 128


def _run(args: tuple[LlamaConfig, bool, str], tp: TensorParallel) -> None:
    """One rank: a prompt through the static path, then DECODES greedy decodes, a chain verify and a
    tree verify through the fused step (or the static path); rank 0 saves logits, features and tokens."""
    from specsplit.models.fused import FusedLlama

    cfg, fused, path = args
    dev = rank_device(DEVICE, tp.rank)
    with torch.device(dev):
        model = LlamaModel(cfg, tp, [0, cfg.num_layers - 1]).eval()
    model.load_full_weights(random_llama_weights(cfg, seed=3, std=0.05))
    cache = model.new_cache(2, CONTEXT)
    slots = torch.ones(1, dtype=torch.long, device=dev)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=g).to(dev)
    step = FusedLlama(model).forward if fused else model.forward
    ctx = 0 if fused else CONTEXT
    with torch.inference_mode():
        logits, _ = model(prompt, Batch.sequence(prompt, slot=1), cache)
        tok, out = logits[-1].argmax().view(1), {"tokens": [], "logits": [], "aux": []}
        for pos in range(PROMPT, PROMPT + DECODES):
            positions = torch.full((1, 1), pos, dtype=torch.long, device=dev)
            logits, aux = step(tok, Batch.padded(positions, slots, positions, ctx, capture=True), cache)
            tok = logits[-1].argmax().view(1)
            out["tokens"].append(int(tok))
            out["logits"].append(logits.cpu().numpy())
            out["aux"].append(aux.float().cpu().numpy())
        start = PROMPT + DECODES
        for name, parents in (("chain", CHAIN), ("tree", TREE)):  # a few rows (kernels.few), then many
            t = len(parents)
            pos_list, rows, cols = tree_layout(start, parents)
            positions = torch.tensor([pos_list], device=dev)
            entries = torch.arange(start, start + t, device=dev).view(1, t)
            visible = torch.zeros(1, t, CONTEXT, dtype=torch.bool, device=dev)
            visible[:, :, :start] = True
            visible[0, rows, cols] = True
            mask = visible[:, :, start : start + t].contiguous()
            tokens = torch.randint(0, cfg.vocab_size, (t,), generator=g).to(dev)
            batch = (Batch.padded(positions, slots, entries, 0, mask, capture=True) if fused
                     else Batch.padded(positions, slots, entries, CONTEXT, visible=visible, capture=True))
            logits, aux = step(tokens, batch, cache)
            out[f"{name}_logits"], out[f"{name}_aux"] = logits.cpu().numpy(), aux.float().cpu().numpy()
    if tp.rank == 0:
        torch.save(out, path)


def _group(cfg: LlamaConfig, world: int, fused: bool) -> dict:
    """Rank 0's outputs of a `world`-rank group (bench.ranks: spawned ranks, gloo or NCCL)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "rank0.pt")
        spawn_ranks(_run, world, (cfg, fused, path), device=DEVICE)
        return torch.load(path, weights_only=False)


def _close(got: np.ndarray, want: np.ndarray, what: str, tol: float = 1e-4) -> None:
    err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    assert got.shape == want.shape and err <= tol * scale, f"{what}: max |diff| {err} of {scale}"


def _check(cfg: LlamaConfig, world: int, fused: bool = True) -> None:
    want, got = _group(cfg, 1, fused=False), _group(cfg, world, fused=fused)
    assert got["tokens"] == want["tokens"]
    for i in range(DECODES):
        _close(got["logits"][i], want["logits"][i], f"decode {i} logits")
        _close(got["aux"][i], want["aux"][i], f"decode {i} features")
    for name in ("chain", "tree"):
        _close(got[f"{name}_logits"], want[f"{name}_logits"], f"{name} logits")
        _close(got[f"{name}_aux"], want[f"{name}_aux"], f"{name} features")
        assert (got[f"{name}_logits"].argmax(-1) == want[f"{name}_logits"].argmax(-1)).all()


@pytest.mark.skipif(not INTERPRETED, reason="the CPU variant runs under TRITON_INTERPRET=1")
@pytest.mark.parametrize("world", [2, 4])
def test_fused_tp_on_the_cpu_equals_one_static_rank(world: int) -> None:
    _check(SMALL, world)


@pytest.mark.skipif(INTERPRETED, reason="on GPUs")
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("shape", list(SHAPED))
@pytest.mark.parametrize("path", ["fused", "padded"])
def test_tp_on_gpus_equals_one_static_rank(path: str, shape: str, world: int) -> None:
    """Either path over `world` GPUs against the padded path on one."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    _check(SHAPED[shape], world, fused=path == "fused")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_services_with_the_fused_step_on_two_ranks_give_the_one_rank_tokens(tiny_target: Path, tiny_head: Path,
                                                                            tmp_path: Path) -> None:
    """fp32, --fused-decode pdl: the target over two GPUs (NCCL) decodes and verifies (chains
    and trees) the tokens of the target on one."""
    reqs = [make_request(token_ids=p, max_new_tokens=24, num_steps=s, topk=k, num_draft_tokens=n)
            for p, s, k, n in [([1, 2, 3], 3, None, None), ([5] * 12, 0, None, None),
                               (list(range(30, 70)), 5, 4, 12)]]
    base = dict(model=str(tiny_target), head=str(tiny_head), max_context=256, dtype="float32", device="cuda",
                hidden_backend="cuda_ipc", draft_device="cuda:0", extra_target_args=["--fused-decode", "pdl"])
    one = run_stack(StackConfig.of(**base, log_dir=tmp_path / "tp1"), reqs)
    two = run_stack(StackConfig.of(**base, tp_size=2, log_dir=tmp_path / "tp2"), reqs)
    assert one == two and all(len(t) == 24 for t in one)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_step_benches_run_over_two_ranks() -> None:
    """bench.verify_step and bench.decode_hbm --tp-size 2: each rank a shard, rank 0's lines."""
    for cmd in (["bench.verify_step", "--rows", "1,4", "--modes", "graphs,fused", "--iters", "3"],
                ["bench.decode_hbm", "--shape", "smollm2-135m", "--modes", "graphs,fused-pdl", "--tokens", "8"]):
        out = subprocess.run([sys.executable, "-m", *cmd, "--tp-size", "2"], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        assert len(rows) >= 2 and all(r["tp_size"] == 2 for r in rows)
