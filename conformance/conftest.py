"""Fixtures for the SGLang conformance suite. It runs in its own environment: `make conformance`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

try:
    import sglang
except ImportError as e:  # the main .venv has no SGLang
    raise pytest.UsageError("the SGLang conformance suite runs in its own environment: `make conformance`") from e

from conformance import compare
from conformance.sglang_cpu import SGLANG_VERSION, load_target, start_sglang_on_cpu
from conformance.specsplit_side import our_target
from specsplit.checkpoints.target_checkpoint import EMBEDDED_DEFAULT, resolve_target_dir
from specsplit.models.llama import LlamaModel
from specsplit.tokenizer import TextCodec

if sglang.__version__ != SGLANG_VERSION:
    raise pytest.UsageError(f"checked against SGLang {SGLANG_VERSION}, found {sglang.__version__}")

torch.set_num_threads(2)
PROMPT = "Why is the sky blue?"


@pytest.fixture(scope="session")
def target_dir() -> Path:
    return resolve_target_dir(EMBEDDED_DEFAULT)


@pytest.fixture(scope="session")
def sglang_target(target_dir: Path) -> torch.nn.Module:
    start_sglang_on_cpu()
    return load_target(target_dir)


@pytest.fixture(scope="session")
def our_default_target() -> LlamaModel:
    return our_target()


@pytest.fixture(scope="session")
def prompt(target_dir: Path) -> torch.Tensor:
    codec = TextCodec.from_checkpoint(target_dir)
    assert codec is not None
    return torch.tensor(codec.encode(codec.render_chat(PROMPT)))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not compare.MEASURED:
        return
    terminalreporter.section(f"differences from SGLang {SGLANG_VERSION} (fp32, CPU)")
    for what, diff, bound in compare.MEASURED:
        terminalreporter.write_line(f"{what:<62} max abs diff {diff:9.3g}   {bound}")
