"""Our side, built as the services build it (public builders only: no model internals)."""

from __future__ import annotations

from pathlib import Path

from draft_service.config import DraftConfig
from draft_service.runtime import build_head
from specsplit.checkpoints.eagle_head import resolve_head_dir, trained_head_dir
from specsplit.checkpoints.target_checkpoint import EMBEDDED_DEFAULT
from specsplit.models.eagle3 import Eagle3Head
from specsplit.models.llama import LlamaModel
from specsplit.models.parallel import TensorParallel
from target_service.config import TargetConfig
from target_service.runtime import build_model


def our_target(draft_config: Path | None = None) -> LlamaModel:
    """The embedded SmolLM2 target in fp32 on CPU; capture ids from `draft_config` as the target service reads them."""
    cfg = TargetConfig(model=EMBEDDED_DEFAULT, dtype="float32", device="cpu",
                       draft_config=None if draft_config is None else str(draft_config))
    return build_model(cfg, TensorParallel())


def our_head(head: str) -> Eagle3Head:
    """A head directory (or `random`) for the embedded target, fp32 on CPU, as the draft service loads it."""
    return build_head(DraftConfig(head=head, target=EMBEDDED_DEFAULT, dtype="float32", device="cpu"))


def head_dir(head: str) -> Path:
    return resolve_head_dir(head, EMBEDDED_DEFAULT)


def default_head() -> str | None:
    """The draft service's default head for the embedded target (the shipped trained one), or
    None if that resolves to a random head."""
    head = DraftConfig().head
    return None if trained_head_dir(head, EMBEDDED_DEFAULT) is None else head
