"""A training run that spans several commands (`train-head --resume`), each as long as a machine
allows: the generated data and the training state live in the output directory, written
atomically, and a resumed command must ask for the same training (what may change: where it runs,
its time budget, logging and saving)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from specsplit.training.config import TrainConfig
from specsplit.training.distill import Sample
from specsplit.training.vocab import DraftVocab

DATA, STATE = "train_data.pt", "train_state.pt"
# settings a resumed command may change: they do not change what is trained
CHANGEABLE = frozenset({"out", "resume", "time_budget", "gen_fraction", "gen_batch_size", "save_every_s",
                        "eval_every", "log_every", "device", "threads", "feature_cache", "max_head_mb", "save_dtype"})


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a command killed mid-write leaves the previous file


def check_same_run(saved: dict, cfg: TrainConfig) -> None:
    """ValueError naming the settings that differ from the saved run's."""
    now = cfg.as_dict()
    differ = sorted(k for k in now if k not in CHANGEABLE and saved.get(k) != now[k])
    if differ:
        shown = ", ".join(f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in differ)
        raise ValueError(f"--resume: {cfg.out} holds another training run ({shown}); use another --out or the "
                         "same settings")


def save_data(out: Path, cfg: TrainConfig, train: list[Sample], val: list[Sample], vocab: DraftVocab,
              generation: dict) -> None:
    _write(out / DATA, {"config": cfg.as_dict(), "generation": generation,
                        "train": [(s.ids, s.prompt_len) for s in train], "val": [(s.ids, s.prompt_len) for s in val],
                        "vocab": {"ids": vocab.ids, "d2t": vocab.d2t, "t2d": vocab.t2d,
                                  "coverage": vocab.coverage}})


def load_data(out: Path, cfg: TrainConfig) -> tuple[list[Sample], list[Sample], DraftVocab, dict] | None:
    """The saved run's (train, val, vocab, generation stats), or None when there is none."""
    if not (out / DATA).exists():
        return None
    d = torch.load(out / DATA, weights_only=True)
    check_same_run(d["config"], cfg)
    train = [Sample(ids, n) for ids, n in d["train"]]
    val = [Sample(ids, n) for ids, n in d["val"]]
    return train, val, DraftVocab(**d["vocab"]), d["generation"]


def save_state(out: Path, state: dict) -> None:
    _write(out / STATE, state)


def load_state(out: Path) -> dict | None:
    """The trainer's saved state (Trainer.state), or None. The file is this run's own (random's state is a tuple)."""
    return torch.load(out / STATE, weights_only=False) if (out / STATE).exists() else None
