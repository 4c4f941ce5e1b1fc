"""`specsplit train-head` settings, validated before anything loads. Importing this module
imports no torch (the CLI builds its flags from these defaults)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class TrainConfig:
    out: str  # output directory: the head (config.json, model.safetensors), train_log.json, train_curves.png
    target: str = "smollm2"  # target directory, .gguf file, or smollm2 (embedded)
    prompts: str = "builtin"  # the shipped prompt set, or a .jsonl / .jsonl.gz file
    num_prompts: int = 0  # train-split prompts to generate for (0: all of them)
    self_instruct: int = 0  # requests the target writes itself (pre-query sampling), added to the prompt set
    self_instruct_temperature: float = 1.0
    self_instruct_max_tokens: int = 96
    max_prompt_tokens: int = 384
    max_new_tokens: int = 256
    gen_batch_size: int = 256  # sequences decoded together
    temperature: float = 0.0  # 0: greedy responses (what greedy speculation sees)
    batch_size: int = 64  # training sequences per step, at most
    batch_tokens: int = 16384  # padded tokens per training step, at most
    feature_cache: str = "auto"  # target features computed once: auto (GPU, else host, if it fits), gpu, cpu, off
    epochs: float = 0.0  # 0: no epoch limit
    max_steps: int = 0  # 0: no step limit
    time_budget: float = 0.0  # seconds for the whole command (0: none); generation, training and saving fit in it
    gen_fraction: float = 0.4  # generation stops starting batches past this share of the budget
    ttt_length: int = 7  # unrolled steps
    step_weight: float = 0.8  # loss weight of step k: step_weight ** k
    draft_vocab: int = 8192
    lr: float = 6e-4
    min_lr_ratio: float = 0.05
    warmup_steps: int = 40
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    val_fraction: float = 0.02
    eval_every: int = 200  # steps (0: only at the end)
    log_every: int = 10
    save_every_s: float = 120.0  # write the head this often during training too (0: only at the end)
    device: str = "auto"  # auto: cuda if available
    dtype: str = "auto"  # the target's compute dtype; auto: bfloat16 on cuda, float32 on cpu
    save_dtype: str = "bfloat16"
    max_head_mb: float = 30.0  # refuse to write a bigger head (0: no limit)
    aux_layer_ids: list[int] | None = None  # None: the EAGLE-3 default of the target
    seed: int = 0
    threads: int = 0  # torch CPU threads (0: torch's default)
    name: str = "specsplit-eagle3"
    resume: bool = False  # go on with the run saved in `out` (its data and training state), else start one there

    def validate(self) -> TrainConfig:
        import torch

        from specsplit.transport.handoff.base import DTYPES

        if not self.out:
            raise ValueError("out: an output directory is required")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        for name in ("dtype", "save_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} {getattr(self, name)!r} not in {sorted(DTYPES)}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device cuda requested but torch sees no CUDA device")
        for name in ("max_prompt_tokens", "max_new_tokens", "gen_batch_size", "batch_size", "batch_tokens",
                     "ttt_length", "draft_vocab", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("num_prompts", "max_steps", "eval_every", "threads", "self_instruct"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.self_instruct and not (self.self_instruct_temperature > 0 and self.self_instruct_max_tokens >= 8):
            raise ValueError("self_instruct needs self_instruct_temperature > 0 and self_instruct_max_tokens >= 8")
        for name in ("epochs", "time_budget", "save_every_s", "weight_decay", "max_head_mb", "temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not (self.epochs or self.max_steps or self.time_budget):
            raise ValueError("give at least one limit: epochs, max_steps or time_budget")
        if self.resume and not (self.epochs or self.max_steps):
            raise ValueError("resume: a run that spans commands needs epochs or max_steps (its schedule)")
        if not 0 < self.gen_fraction < 1:
            raise ValueError("gen_fraction must be in (0, 1)")
        if not 0 <= self.val_fraction < 0.5:
            raise ValueError("val_fraction must be in [0, 0.5)")
        if not 0 < self.step_weight <= 1:
            raise ValueError("step_weight must be in (0, 1]")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.grad_clip > 0 and self.warmup_steps >= 0):
            raise ValueError("need lr > 0, 0 <= min_lr_ratio <= 1, grad_clip > 0, warmup_steps >= 0")
        if self.feature_cache not in ("auto", "gpu", "cpu", "off"):
            raise ValueError(f"feature_cache {self.feature_cache!r}: auto, gpu, cpu or off")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError("aux_layer_ids: three layer ids")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        from specsplit.transport.handoff.base import DTYPES

        return DTYPES[self.dtype]

    def as_dict(self) -> dict:
        return asdict(self)
