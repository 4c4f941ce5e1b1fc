from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_service.config import DraftConfig
from gateway.local import LocalEngines
from specsplit.checkpoints.eagle_head import random_head, save_head
from specsplit.checkpoints.target_checkpoint import load_target_config, resolve_target_dir
from specsplit.checkpoints.tiny import tiny_config, write_tiny_target
from specsplit.cli.client import GatewayClient
from specsplit.cli.launcher import ServiceStack
from target_service.config import TargetConfig

torch.set_num_threads(2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def client(stack: ServiceStack) -> GatewayClient:
    """The gateway client of the module's `stack` fixture."""
    c = GatewayClient(stack.addr("gateway"))
    yield c
    c.close()


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("tiny") / "target", tiny_config(), seed=1)


@pytest.fixture(scope="session")
def tiny_head(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "head"
    cfg, weights = random_head(load_target_config(tiny_target), draft_vocab_size=384, seed=2, std=0.2)
    save_head(out, cfg, weights)
    return out


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_target_dir("smollm2")


@pytest.fixture(scope="module")
def tiny_engines(tiny_target: Path, tiny_head: Path) -> LocalEngines:
    """The tiny target and its random head in one process (gateway.local)."""
    engines = LocalEngines(TargetConfig(model=str(tiny_target), max_context=256),
                           DraftConfig(head=str(tiny_head), target=str(tiny_target), max_context=256))
    yield engines
    engines.close()
