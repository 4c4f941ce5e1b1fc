"""The quick start's main job: `specsplit demo` brings the services up, streams one
generation, prints a summary and exits 0 (outputs identical with and without drafts)."""

from __future__ import annotations

import subprocess
import sys

from specsplit.ports import free_port


def test_demo_runs_end_to_end(tmp_path) -> None:  # noqa: ANN001
    ports = [str(free_port()) for _ in range(3)]
    proc = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "demo", "What is 2 + 2?", "--max-new-tokens", "12",
         "--gateway-port", ports[0], "--target-port", ports[1], "--draft-port", ports[2],
         "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mean accepted length" in proc.stdout and "tok/s" in proc.stdout
    assert "outputs identical" in proc.stdout
