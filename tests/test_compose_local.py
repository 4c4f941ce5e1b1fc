"""`specsplit compose-local`: docker-compose.yml's services as processes on a host without Docker,
with the commands and environment the compose file gives each container (a lent GPU host runs
the product's layout this way)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.compose_local import interpolate, plan

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"


def test_compose_variables_as_compose_reads_them() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} ${UNSET:-$SET} $SET $$SET ${UNSET}", env) == \
        "x d  d x x $SET "


def test_the_gpu_profile_runs_as_the_compose_file_lays_it_out(tmp_path: Path) -> None:
    services, foreign = plan(COMPOSE, ["gpu", "jaeger"], tmp_path,
                             env={"SPECSPLIT_TP_SIZE": "2", "SPECSPLIT_DRAFT_GPUS": "1"})
    by = {s.name: s for s in services}
    assert [s.name for s in services] == ["target", "draft", "gateway", "smg"] and foreign == ["jaeger"]
    target, draft, gateway, smg = (by[n] for n in ("target", "draft", "gateway", "smg"))
    argv = " ".join(target.argv)
    assert "torch.distributed.run" in argv or target.argv[0].endswith("torchrun")
    assert "--nproc-per-node 2 -m target_service --host 127.0.0.1 --port 50061" in argv  # loopback, not 0.0.0.0
    assert target.env["SPECSPLIT_TARGET_STEP_SOCKET"] == f"{tmp_path}/specsplit-sockets/target.sock"
    assert target.env["SPECSPLIT_CACHE"] == f"{tmp_path}/specsplit-cache"  # the image's ENV, on its volume
    assert target.env["SPECSPLIT_MODEL"] == f"{ROOT}/models/target"  # the bind mount's source
    assert target.env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4317"  # the jaeger service's address
    assert "CUDA_VISIBLE_DEVICES" not in target.env and draft.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert draft.depends == ["target"] and gateway.depends == ["target", "draft"] and smg.depends == ["gateway"]
    assert gateway.argv[gateway.argv.index("--target") + 1] == "127.0.0.1:50061"
    assert gateway.argv[gateway.argv.index("--draft") + 1] == "127.0.0.1:50062"
    assert smg.argv[:2] == ["smg", "launch"]  # the image's entrypoint
    assert draft.health is not None and draft.health[-4:] == ["health", "127.0.0.1:50062", "--service",
                                                              "specsplit.v1.DraftService"]


def test_free_ports_move_each_port_wherever_it_is_named(tmp_path: Path) -> None:
    services, _ = plan(COMPOSE, ["cpu"], tmp_path, only=["target-cpu", "draft-cpu", "gateway-cpu"], env={},
                       free_ports=True)
    target, _, gateway = services
    port = target.argv[target.argv.index("--port") + 1]
    assert port != "50061"
    assert gateway.argv[gateway.argv.index("--target") + 1] == f"127.0.0.1:{port}"
    assert target.health is not None and f"127.0.0.1:{port}" in target.health
    with pytest.raises(ValueError, match="not services of profiles cpu: target"):
        plan(COMPOSE, ["cpu"], tmp_path, only=["target"], env={})


def test_the_cpu_stack_runs_here_without_docker_and_stops_on_sigterm(tmp_path: Path) -> None:
    """target-cpu, draft-cpu and gateway-cpu from the compose file's commands: a generation streams
    through the gateway with speculation; SIGTERM stops every service."""
    proc = subprocess.Popen([sys.executable, "-m", "specsplit.cli", "compose-local", "--profile", "cpu", "--services",
                             "target-cpu,draft-cpu,gateway-cpu", "--free-ports", "--state", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "compose-local ended early:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("all started"):
                break
        out = "".join(lines)
        assert "target-cpu: healthy" in out and "draft-cpu: healthy" in out and "gateway-cpu: healthy" in out
        port = re.search(r"gateway-cpu: started .* --port (\d+)", out)
        assert port is not None
        client = GatewayClient(f"127.0.0.1:{port.group(1)}")
        try:
            gen = client.generate(make_request("Count from one to ten.", max_new_tokens=16), timeout=300)
        finally:
            client.close()
        assert len(gen.token_ids) == 16 and gen.final.speculation.cycles > 0
        pids = [int(p) for p in re.findall(r"started \(pid (\d+)", out)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for pid in pids:  # every service's process is gone (reaped by compose-local)
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        assert (tmp_path / "logs" / "gateway-cpu.log").stat().st_size > 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
