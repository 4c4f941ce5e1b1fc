"""docker-compose.yml, checked without a Docker engine: against the Compose Specification's
JSON schema (the copy check-jsonschema ships), then for what the stack needs: profiles,
start order driven by health, GPU reservations, shared IPC/PID for CUDA IPC, ports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
STACK = ("target", "draft", "gateway", "smg")
PROFILES = {"gpu": {s: s for s in STACK}, "cpu": {s: f"{s}-cpu" for s in STACK}}  # role -> service name
# ids "gpu-profile" and "cpu-profile": a bare "gpu" keyword marks a test as needing CUDA (conftest.py)
each_profile = pytest.mark.parametrize("profile", list(PROFILES), ids=lambda p: f"{p}-profile")


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def active(services: dict[str, dict], profile: str) -> set[str]:
    """The services `docker compose --profile <profile> up` starts."""
    return {name for name, s in services.items() if not s.get("profiles") or profile in s["profiles"]}


def test_valid_against_the_compose_spec_schema() -> None:
    proc = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(COMPOSE)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_default_profiles_are_gpu_and_jaeger() -> None:
    env = dict(line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert env["COMPOSE_PROFILES"] == "gpu,jaeger"


@each_profile
def test_each_profile_runs_the_whole_stack(services: dict[str, dict], profile: str) -> None:
    assert active(services, profile) == set(PROFILES[profile].values())


def test_the_trace_ui_is_a_profile_of_its_own(services: dict[str, dict]) -> None:
    assert services["jaeger"]["profiles"] == ["jaeger"] and services["phoenix"]["profiles"] == ["phoenix"]
    assert services["phoenix"]["build"]["target"] == "phoenix"
    assert services["phoenix"]["environment"]["PHOENIX_GRPC_PORT"] == "4317"  # OTLP in, as Jaeger


@each_profile
def test_start_order_follows_health(services: dict[str, dict], profile: str) -> None:
    name = PROFILES[profile]
    running = active(services, profile)
    expected = {"draft": {name["target"]: "service_healthy"},
                "gateway": {name["target"]: "service_healthy", name["draft"]: "service_healthy"},
                "smg": {name["gateway"]: "service_healthy"}}
    assert "depends_on" not in services[name["target"]]  # traces are exported in the background: no UI needed
    for role, deps in expected.items():
        got = {dep: cond["condition"] for dep, cond in services[name[role]]["depends_on"].items()}
        assert got == deps, role
        assert set(got) <= running
    for role in STACK:
        check = services[name[role]]["healthcheck"]["test"]
        assert check[0] == "CMD" and check[1:3] in (["specsplit", "health"], ["python", "-c"]), check


def test_grpc_health_checks_name_each_service(services: dict[str, dict]) -> None:
    for profile in PROFILES.values():
        for role, grpc_service, port in (("target", "TargetService", 50061), ("draft", "DraftService", 50062),
                                         ("gateway", "Gateway", 50051)):
            s = services[profile[role]]
            assert s["healthcheck"]["test"][1:] == ["specsplit", "health", f"127.0.0.1:{port}", "--service",
                                                    f"specsplit.v1.{grpc_service}"]
            host = s["command"].index("--host")  # reachable from the other containers, on that port
            assert s["command"][host:host + 4] == ["--host", "0.0.0.0", "--port", str(port)]


def gpu_devices(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_gpu_layout(services: dict[str, dict]) -> None:
    target, draft = services["target"], services["draft"]
    assert gpu_devices(target) == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert target["command"][:5] == ["torchrun", "--standalone", "--nproc-per-node", "${SPECSPLIT_TP_SIZE:-8}", "-m"]
    assert target["command"][5] == "target_service" and "cuda_ipc" in target["command"]
    (device,) = gpu_devices(draft)
    assert device["device_ids"] == ["${SPECSPLIT_DRAFT_GPUS:-0}"] and "count" not in device
    assert "${SPECSPLIT_DRAFT_DEVICE:-cuda:0}" in draft["command"]
    for role in ("gateway", "smg"):
        assert not gpu_devices(services[role])
    for name in PROFILES["cpu"].values():
        assert not gpu_devices(services[name]) and "cuda" not in " ".join(services[name]["command"])


@each_profile
def test_draft_shares_the_target_ipc_and_pid_namespaces(services: dict[str, dict], profile: str) -> None:
    target, draft = PROFILES[profile]["target"], PROFILES[profile]["draft"]
    assert services[target]["ipc"] == "shareable"
    assert services[draft]["ipc"] == services[draft]["pid"] == f"service:{target}"


@each_profile
def test_smg_fronts_the_gateway_and_traces_go_to_the_ui(services: dict[str, dict], profile: str) -> None:
    name = PROFILES[profile]
    smg = services[name["smg"]]["command"]
    assert smg[0] == "launch" and smg[smg.index("--worker-urls") + 1] == f"grpc://{name['gateway']}:50051"
    for role in ("target", "draft", "gateway"):
        env = services[name[role]]["environment"]
        assert env["OTEL_TRACES_EXPORTER"] == "otlp" and env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${SPECSPLIT_OTLP_ENDPOINT:-http://jaeger:4317}"
    assert "receivers.otlp.protocols.grpc.endpoint=0.0.0.0:4317" in services["jaeger"]["command"]
    assert services[name["gateway"]]["environment"]["SPECSPLIT_SERVED_MODEL_NAME"].startswith(
        "${SPECSPLIT_SERVED_MODEL_NAME:-")
    if profile == "cpu":
        assert services[name["target"]]["environment"]["SPECSPLIT_MODEL"] == "smollm2"
        assert services[name["gateway"]]["environment"]["SPECSPLIT_SERVED_MODEL_NAME"] == (
            "${SPECSPLIT_SERVED_MODEL_NAME:-SmolLM2-135M-Instruct}")
        assert services[name["draft"]]["environment"]["SPECSPLIT_HEAD"] == "default"


def test_only_loopback_ports_are_published(services: dict[str, dict]) -> None:
    published = {name: s.get("ports", []) for name, s in services.items()}
    assert {n for n, p in published.items() if p} == {"jaeger", "phoenix", "gateway", "smg", "gateway-cpu",
                                                             "smg-cpu"}
    for ports in published.values():
        assert all(p.startswith("127.0.0.1:") for p in ports), ports


def test_no_build_argument_points_at_another_index_by_default() -> None:
    text = COMPOSE.read_text()
    assert "TORCH_INDEX_URL: ${SPECSPLIT_TORCH_INDEX_URL:-}" in text
    assert 'ARG TORCH_INDEX_URL=""' in (ROOT / "docker/Dockerfile").read_text()
