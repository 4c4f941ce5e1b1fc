"""The draft vocabulary: the most frequent response tokens, stored as SGLang / SpecForge do.

draft ids are sorted target ids; d2t[i] = target_id(i) - i (int64, differences, so the
head maps a draft id i to i + d2t[i]); t2d is a bool mask over the target vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsplit.training.distill import Sample


@dataclass
class DraftVocab:
    ids: torch.Tensor  # [Vd] target ids, ascending
    d2t: torch.Tensor  # [Vd] int64
    t2d: torch.Tensor  # [V] bool
    coverage: float  # share of the counted tokens that the draft vocabulary holds

    @property
    def size(self) -> int:
        return int(self.ids.numel())


def count_response_tokens(samples: list[Sample], vocab_size: int) -> torch.Tensor:
    """Occurrences of each target id among the response tokens -> [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s.ids[s.prompt_len:], minlength=vocab_size)
    return counts


def build_vocab(counts: torch.Tensor, draft_size: int) -> DraftVocab:
    """The `draft_size` most frequent ids (ties and unseen fillers: lower ids first)."""
    v = counts.numel()
    if not 0 < draft_size <= v:
        raise ValueError(f"draft vocabulary size {draft_size} outside 1..{v}")
    # stable sort of -count keeps equal counts in id order
    order = torch.sort(-counts, stable=True).indices
    ids = order[:draft_size].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    total = int(counts.sum())
    coverage = float(counts[ids].sum()) / total if total else 0.0
    return DraftVocab(ids, ids - torch.arange(draft_size), t2d, coverage)
