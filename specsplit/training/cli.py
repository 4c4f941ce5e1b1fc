"""Flags of `specsplit train-head`, one per TrainConfig field (no torch import until it runs)."""

from __future__ import annotations

import argparse
import dataclasses

from specsplit.training.config import TrainConfig

_HELP = {
    "out": "output directory: the head (config.json + model.safetensors), train_log.json, train_curves.png",
    "target": "target: a directory, a .gguf file, or smollm2 (the embedded default)",
    "prompts": "builtin (the shipped set) or a .jsonl[.gz] of {\"text\": ...} records",
    "num_prompts": "train prompts to generate responses for (0: all)",
    "self_instruct": "also this many requests written by the target itself (pre-query sampling; 0: none)",
    "self_instruct_temperature": "sampling temperature of the self-written requests",
    "self_instruct_max_tokens": "longest self-written request, in tokens",
    "gen_batch_size": "sequences generated together",
    "temperature": "0: greedy responses",
    "batch_size": "training sequences per step, at most",
    "batch_tokens": "padded tokens per training step, at most",
    "feature_cache": "the target's features computed once before training: auto (the GPU, else host memory, "
                     "when it fits in half of what is free), gpu, cpu, off (the target runs for every batch)",
    "epochs": "0: no epoch limit",
    "max_steps": "0: no step limit",
    "time_budget": "seconds for the whole command (0: none): stops generating, then training, in time to save",
    "gen_fraction": "share of the time budget after which no new generation batch starts",
    "ttt_length": "training-time-test steps unrolled",
    "step_weight": "loss weight of step k is step_weight**k",
    "draft_vocab": "draft vocabulary size (most frequent response tokens)",
    "device": "auto, cpu, cuda, cuda:N",
    "dtype": "the target's dtype (auto: bfloat16 on cuda, float32 on cpu); the head trains in fp32 with autocast",
    "save_dtype": "dtype of the written weights",
    "aux_layer_ids": "comma-separated target layers to capture (default: the EAGLE-3 default)",
    "save_every_s": "also write the head this often while training (0: only at the end)",
    "resume": "go on with the run saved in --out (its generated data and training state; the same settings but "
              "device, time budget, logging and saving), or start one there that a later --resume continues",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-head", help="train an EAGLE-3 head for a target by self-distillation",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "out":
            p.add_argument(flag, required=True, help=_HELP[f.name])
        elif f.name == "aux_layer_ids":
            p.add_argument(flag, default=None, help=_HELP[f.name])
        elif isinstance(f.default, bool):
            p.add_argument(flag, action="store_true", help=_HELP[f.name])
        else:
            p.add_argument(flag, type=type(f.default), default=f.default, help=_HELP.get(f.name, " "))


def run(a: argparse.Namespace) -> int:
    from specsplit.training.pipeline import run as run_pipeline

    values = {f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig)}
    if values["aux_layer_ids"] is not None:
        values["aux_layer_ids"] = [int(x) for x in values["aux_layer_ids"].split(",")]
    run_pipeline(TrainConfig(**values))
    return 0
