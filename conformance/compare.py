"""The pass criteria, and a record of every difference measured (printed after the run)."""

from __future__ import annotations

import torch

LOGIT_ATOL = 1e-4  # max abs difference in logits
# Hidden states span a wide range (SmolLM2's outlier features reach ~2.5e4, where one fp32 step
# is ~2e-3), so each token's row is held to a bound relative to that row's largest magnitude.
HIDDEN_RTOL = 1e-5

# (what, max abs diff, the bound it was held to)
MEASURED: list[tuple[str, float, str]] = []


def _check_shape(what: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs SGLang's {tuple(ref.shape)}"


def assert_logits_match(what: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    _check_shape(what, ours, ref)
    diff = float((ours.float() - ref.float()).abs().max())
    MEASURED.append((what, diff, f"<= {LOGIT_ATOL:g}"))
    assert diff <= LOGIT_ATOL, f"{what}: max abs logit difference {diff:.3g} > {LOGIT_ATOL}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), f"{what}: argmax differs"


def assert_hidden_match(what: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Per token row: max abs difference <= HIDDEN_RTOL * max(1, the row's max abs value)."""
    _check_shape(what, ours, ref)
    row_diff = (ours.float() - ref.float()).abs().amax(-1)
    row_scale = ref.float().abs().amax(-1).clamp(min=1.0)
    worst = float((row_diff / row_scale).max())
    MEASURED.append((what, float(row_diff.max()), f"{worst:.2g} x row scale (<= {HIDDEN_RTOL:g})"))
    assert worst <= HIDDEN_RTOL, f"{what}: a row differs by {worst:.3g} x its scale > {HIDDEN_RTOL}"
