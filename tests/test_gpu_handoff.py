"""bench.gpu_handoff: two processes taking turns on one GPU through each handoff."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.gpu_handoff", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_a_gpu() -> None:
    out = _run("--cycles", "5")
    assert out.returncode == 2 and "no CUDA device is visible" in out.stderr


def test_refuses_bad_arguments() -> None:
    assert "unknown mode 'both'" in _run("--modes", "sync,both").stderr
    assert "--ahead and --cycles" in _run("--ahead", "0").stderr


@pytest.mark.gpu
@pytest.mark.quick
def test_every_handoff_runs_its_cycles() -> None:
    out = _run("--a-us", "200", "--b-us", "50", "--host-us", "20", "--cycles", "50", "--warmup", "5")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["mode"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert set(rows) == {"sync", "event", "one"}
    for r in rows.values():  # no cycle can take less than its two kernels
        assert r["us_per_cycle"] >= 0.95 * r["kernels_us"] > 0


def test_an_mps_daemon_is_seen_by_its_control_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.gpu_handoff import mps_daemon

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_daemon()
    (tmp_path / "control").touch()
    assert mps_daemon()
