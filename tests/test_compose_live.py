"""docker-compose.yml run for real: the CPU stack built and brought up by Docker Compose, a generation streamed
over gRPC and over smg's OpenAI HTTP API from the host, its trace read back from the trace UI's own API, the
published port checked for loopback only, the draft container killed mid-stream, and the stack taken down.

Runs only under `make compose-check` (SPECSPLIT_COMPOSE_CHECK=1). docker/engine.sh finds a Docker engine
(Engine >= 25, Compose >= 2.20) or starts one from Debian's packages, and stops what it started; when it
cannot, every test here skips with its one-line reason. Jaeger is the trace UI where its image can be pulled,
Phoenix otherwise. The stack runs as its own Compose project on free host ports."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from specsplit.checkpoints import EMBEDDED_NAME
from specsplit.cli.client import GatewayClient, make_request
from specsplit.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "specsplit-check"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
pytestmark = [pytest.mark.compose, pytest.mark.timeout(3600)]


def run(cmd: list[str], env: dict[str, str], timeout: float = 120, check: bool = True
        ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc


def compose(env: dict[str, str], *args: str, timeout: float = 120, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
    return run(["docker", "compose", "-p", PROJECT, *args], env, timeout, check)


@pytest.fixture(scope="module")
def engine() -> Iterator[dict[str, str]]:
    """The environment that reaches a Docker engine with Compose v2."""
    if os.environ.get("SPECSPLIT_COMPOSE_CHECK") != "1":
        pytest.skip("a live Docker Compose check: run it with `make compose-check`")
    proc = subprocess.run([str(ROOT / "docker/engine.sh"), "start"], capture_output=True, text=True, timeout=900)
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr
    env = dict(os.environ)
    env.update(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    env.pop("COMPOSE_PROFILES", None)
    yield env
    subprocess.run([str(ROOT / "docker/engine.sh"), "stop"], timeout=120)


def pullable(image: str, env: dict[str, str]) -> bool:
    if run(["docker", "image", "inspect", image], env, check=False).returncode == 0:
        return True
    try:
        return run(["docker", "pull", "-q", image], env, timeout=300, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def extra_ca_certs() -> str:
    """SPECSPLIT_EXTRA_CA_CERTS, else the certificates this host adds to its trust store (a proxy's)."""
    if "SPECSPLIT_EXTRA_CA_CERTS" in os.environ:
        return os.environ["SPECSPLIT_EXTRA_CA_CERTS"]
    return "".join(p.read_text() for p in sorted(Path("/usr/local/share/ca-certificates").glob("**/*.crt")))


def cpu_wheels() -> str:
    """SPECSPLIT_CPU_WHEELS, else a directory of this host's pip find-links that holds a CPU-only torch wheel."""
    if "SPECSPLIT_CPU_WHEELS" in os.environ:
        return os.environ["SPECSPLIT_CPU_WHEELS"]
    config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    links = [v.strip("'") for k, v in (ln.split("=", 1) for ln in config.splitlines() if "=" in ln)
             if k.endswith("find-links")]
    for d in " ".join(links).split():
        if list(Path(d).glob("torch-*+cpu-*.whl")):
            return d
    return ""


class Stack:
    def __init__(self, env: dict[str, str], ui: str) -> None:
        self.env, self.ui = env, ui
        self.grpc_port = int(env["SPECSPLIT_GATEWAY_PORT"])
        self.http_port = int(env["SPECSPLIT_HTTP_PORT"])
        self.ui_port = int(env["SPECSPLIT_JAEGER_UI_PORT" if ui == "jaeger" else "SPECSPLIT_PHOENIX_UI_PORT"])

    def container(self, service: str) -> str:
        return compose(self.env, "ps", "-q", service).stdout.strip()

    def span_names(self, trace_id: str) -> list[str]:
        """The names of the trace's spans, as the trace UI's query API returns them."""
        if self.ui == "jaeger":
            body = http_json(f"http://127.0.0.1:{self.ui_port}/api/traces/{trace_id}")
            return [s["operationName"] for t in body.get("data") or [] for s in t["spans"]]
        names, cursor = [], ""
        while True:
            body = http_json(f"http://127.0.0.1:{self.ui_port}/v1/projects/default/spans?limit=1000{cursor}")
            names += [s["name"] for s in body["data"] if s["context"]["trace_id"] == trace_id]
            if not body.get("next_cursor"):
                return names
            cursor = f"&cursor={body['next_cursor']}"


def http_json(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def stack(engine: dict[str, str]) -> Iterator[Stack]:
    jaeger_image = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["jaeger"]["image"]
    ui = "jaeger" if pullable(jaeger_image, engine) else "phoenix"
    base = run([str(ROOT / "docker/base-image.sh"), os.environ.get("SPECSPLIT_PYTHON_IMAGE", "")], engine,
               timeout=900).stdout.strip().splitlines()[-1]
    env = engine | {
        "COMPOSE_PROFILES": f"cpu,{ui}", "SPECSPLIT_PYTHON_IMAGE": base,
        "SPECSPLIT_EXTRA_CA_CERTS": extra_ca_certs(), "SPECSPLIT_CPU_WHEELS": cpu_wheels() or "./docker/wheels",
        "SPECSPLIT_TRACE_RATIO": "1", "SPECSPLIT_OTLP_ENDPOINT": f"http://{ui}:4317",
        "SPECSPLIT_GATEWAY_PORT": str(free_port()), "SPECSPLIT_HTTP_PORT": str(free_port()),
        "SPECSPLIT_JAEGER_UI_PORT": str(free_port()), "SPECSPLIT_PHOENIX_UI_PORT": str(free_port()),
    }
    compose(env, "down", "-v", "--remove-orphans", check=False)
    try:
        compose(env, "build", timeout=2400)
        compose(env, "up", "-d", "--wait", "--wait-timeout", "600", timeout=700)
        yield Stack(env, ui)
    finally:
        if compose(env, "ps", "-a", check=False).returncode == 0:
            logs = compose(env, "logs", "--no-color", "--tail", "40", check=False).stdout
            print(logs[-6000:])
        compose(env, "down", "-v", "--remove-orphans", timeout=300, check=False)


@pytest.mark.parametrize("profiles,services", [
    ("gpu,jaeger", {"jaeger", "target", "draft", "gateway", "smg"}),
    ("cpu,phoenix", {"phoenix", "target-cpu", "draft-cpu", "gateway-cpu", "smg-cpu"}),
], ids=["gpu-and-jaeger", "cpu-and-phoenix"])
def test_compose_v2_accepts_each_profile(engine: dict[str, str], profiles: str, services: set[str]) -> None:
    env = engine | {"COMPOSE_PROFILES": profiles}
    compose(env, "config", "--quiet")
    assert set(compose(env, "config", "--services").stdout.split()) == services


def test_a_generation_streams_over_grpc_with_its_cycles_in_the_trace_ui(stack: Stack) -> None:
    trace_id = os.urandom(16).hex()
    client = GatewayClient(f"127.0.0.1:{stack.grpc_port}")
    try:
        stream = client.stub.Generate(make_request(PROMPT, max_new_tokens=24), timeout=120,
                                      metadata=[("traceparent", f"00-{trace_id}-{os.urandom(8).hex()}-01")])
        chunks = [m for m in stream if m.token_ids]
    finally:
        client.close()
    assert len(chunks) >= 2 and sum(len(m.token_ids) for m in chunks) == 24
    deadline, names = time.monotonic() + 60, []
    while time.monotonic() < deadline:  # the services export spans in batches, every few seconds
        try:
            names = stack.span_names(trace_id)
        except (OSError, http.client.HTTPException):  # the UI dropped a query while it ingests: ask again
            time.sleep(2)
            continue
        if "generate" in names and "cycle" in names and "target.verify" in names and "draft.extend_propose" in names:
            break
        time.sleep(2)
    assert {"generate", "prefill", "cycle", "target.verify", "draft.extend_propose"} <= set(names), names
    assert names.count("cycle") >= 2


def test_smg_lists_the_served_name_and_streams_a_chat(stack: Stack) -> None:
    base = f"http://127.0.0.1:{stack.http_port}/v1"
    assert EMBEDDED_NAME in [m["id"] for m in http_json(f"{base}/models")["data"]]
    req = urllib.request.Request(f"{base}/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": EMBEDDED_NAME, "stream": True, "max_tokens": 16,
                                                  "messages": [{"role": "user", "content": PROMPT}]}).encode())
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if json.loads(e)["choices"])
    assert len(events) > 3 and text.strip()


def host_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback (its own and the Docker bridges')."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    return [f.split()[3].split("/")[0] for f in out.splitlines() if " lo " not in f]


def test_published_ports_answer_on_loopback_only(stack: Stack) -> None:
    others = host_addresses()
    assert others, "no non-loopback address to check against"
    for port in (stack.grpc_port, stack.http_port, stack.ui_port):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        for addr in others:
            with pytest.raises(OSError):
                socket.create_connection((addr, port), timeout=2).close()


def test_killing_the_draft_mid_stream_keeps_the_tokens(stack: Stack) -> None:
    req = make_request(PROMPT, max_new_tokens=160, ignore_eos=True)
    client = GatewayClient(f"127.0.0.1:{stack.grpc_port}")
    try:
        reference = client.generate(req, timeout=300)
        assert reference.final.speculation.cycles > 0
        draft = stack.container("draft-cpu")
        tokens, killed = [], False
        for msg in client.stream(req, timeout=300):
            tokens += msg.token_ids
            if len(tokens) >= 8 and not killed:
                run(["docker", "kill", draft], stack.env)
                killed = True
        assert killed
        assert tokens == reference.token_ids
    finally:
        client.close()
