"""docker-compose.yml's services as processes on this host, for a machine without Docker (a lent
GPU host): `specsplit compose-local`. Each service of the chosen profiles runs its compose command
with the environment its container gets (its image's ENV and entrypoint from docker/Dockerfile,
then the compose file's), in the order the depends_on conditions give: a service starts once
those it depends on pass their healthcheck, run here as written. What differs from a container:

- a service name in an address (`target:50061`, `http://jaeger:4317`) is 127.0.0.1, and
  `0.0.0.0` binds 127.0.0.1 (loopback by default; `--bind-all` keeps 0.0.0.0);
- every service's ports share this host: with `--free-ports` each `--port` is moved to a free
  one, in every command, variable and healthcheck that names it;
- a mount point (`/models`, `/cache`, `/run/specsplit`) at the start of an argument or variable
  is the volume's folder here: a bind mount's source, a named volume's folder under `--state`;
- a GPU reservation with `device_ids` is CUDA_VISIBLE_DEVICES (`count: all`: every GPU);
- ipc and pid sharing, shm_size, restart policies and published ports do not apply.

Each service's output goes to `<state>/logs/<service>.log`; Ctrl-C (or SIGTERM) stops them all,
in the reverse order, as does any of them exiting."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specsplit.cli.launcher import free_port

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_]\w*)(?:(:?)-([^}]*))?\}|\$([A-Za-z_]\w*)")
_MODULES = {"specsplit": ["-m", "specsplit.cli"], "torchrun": ["-m", "torch.distributed.run"]}


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable syntax: $VAR, ${VAR}, ${VAR:-default} (unset or empty), ${VAR-default}
    (unset), $$ for a dollar sign."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        value = env.get(name)
        if m.group(3) is not None and (value is None or (m.group(2) and not value)):
            return interpolate(m.group(3), env)
        return value or ""

    return _VAR.sub(one, text)


def dot_env(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a compose .env file ('#' comments, blank lines skipped)."""
    if not path.is_file():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#"))
    return {k.strip(): v.strip().strip("'\"") for k, v in pairs}


def image_setup(dockerfile: Path, stage: str) -> tuple[dict[str, str], list[str]]:
    """The ENV and ENTRYPOINT that a Dockerfile stage (and the stages it is built FROM) gives its image."""
    stages: dict[str, tuple[str, list[str]]] = {}  # name -> (parent, its lines)
    current: list[str] = []
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    for line in text.splitlines():
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line.strip(), re.IGNORECASE)
        if m:
            current = []
            stages[m.group(2) or m.group(1)] = (m.group(1), current)
        else:
            current.append(line.strip())
    chain: list[list[str]] = []
    name: str | None = stage
    while name in stages:
        parent, lines = stages[name]
        chain.insert(0, lines)
        name = parent if parent != name else None
    env: dict[str, str] = {}
    entrypoint: list[str] = []
    for line in (x for lines in chain for x in lines):
        if line.upper().startswith("ENV "):
            env.update(dict(pair.split("=", 1) for pair in line[4:].split() if "=" in pair))
        elif line.upper().startswith("ENTRYPOINT "):
            entrypoint = yaml.safe_load(line[11:])
    return env, entrypoint


@dataclass
class Service:
    name: str
    argv: list[str]
    env: dict[str, str]  # what the compose file and the image set (the rest comes from this process)
    depends: list[str] = field(default_factory=list)
    health: list[str] | None = None  # a command that exits 0 once the service is healthy
    start_period_s: float = 300.0
    volumes: list[str] = field(default_factory=list)  # the named volumes' folders it mounts


def _seconds(text: str) -> float:
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", str(text))) or 300.0


def _executable(argv: list[str]) -> list[str]:
    """argv with its program found here: python is this interpreter; specsplit and torchrun, when
    not on PATH, their modules run by it."""
    if argv and argv[0] == "python":
        return [sys.executable, *argv[1:]]
    if argv and shutil.which(argv[0]) is None and argv[0] in _MODULES:
        return [sys.executable, *_MODULES[argv[0]], *argv[1:]]
    return argv


def plan(compose: Path, profiles: list[str], state: Path, only: list[str] | None = None,
         env: Mapping[str, str] | None = None, free_ports: bool = False, bind_all: bool = False
         ) -> tuple[list[Service], list[str]]:
    """The services that `docker compose --profile P... up` starts (or `only` those), in start
    order, each as this host runs it; and those left out: images not built from this
    repository (a trace UI), which have no program here."""
    variables = {**dot_env(compose.parent / ".env"), **(os.environ if env is None else env)}
    spec = yaml.safe_load(compose.read_text())
    defined: dict[str, dict[str, Any]] = spec["services"]
    chosen = [n for n, s in defined.items() if not s.get("profiles") or set(profiles) & set(s["profiles"])]
    if only:
        unknown = sorted(set(only) - set(chosen))
        if unknown:
            raise ValueError(f"not services of profiles {','.join(profiles)}: {', '.join(unknown)}")
        chosen = [n for n in chosen if n in only]
    foreign = [n for n in chosen if not defined[n].get("build")]
    chosen = [n for n in chosen if n not in foreign]
    names = "|".join(sorted(map(re.escape, defined), key=len, reverse=True))
    address = re.compile(rf"(?<![\w.-])({names})(?=:\d)")
    ports: dict[str, str] = {}
    if free_ports:
        for n in chosen:
            command = [interpolate(str(x), variables) for x in defined[n].get("command", [])]
            for flag, value in zip(command, command[1:], strict=False):
                if flag == "--port":
                    ports[value] = str(free_port())
    moved = re.compile(rf"(?<=:)({'|'.join(map(re.escape, ports))})(?!\d)") if ports else None

    def local(text: str, mounts: list[tuple[str, str]]) -> str:
        text = address.sub("127.0.0.1", text)
        if not bind_all:
            text = text.replace("0.0.0.0", "127.0.0.1")
        if moved is not None:
            text = moved.sub(lambda m: ports[m.group(1)], text)
        for inside, here in mounts:
            if text == inside or text.startswith(inside + "/"):
                return here + text[len(inside):]
        return text

    out: list[Service] = []
    for n in chosen:
        s = defined[n]
        mounts, named = [], []
        for volume in s.get("volumes", []):
            source, inside = interpolate(volume, variables).split(":")[:2]
            bind = source.startswith((".", "/"))
            here = (compose.parent / source).resolve() if bind else state / source
            mounts.append((inside, str(here)))
            named += [] if bind else [str(here)]
        build = s.get("build") or {}
        image_env, entrypoint = image_setup(compose.parent / build.get("dockerfile", "Dockerfile"),
                                            build.get("target", "")) if build else ({}, [])
        environment = {**image_env, **{k: "" if v is None else str(v) for k, v in (s.get("environment") or {}).items()}}
        argv = [*entrypoint, *(str(x) for x in s.get("command", []))]
        argv = [local(interpolate(x, variables), mounts) for x in argv]
        argv = [ports.get(x, x) if flag == "--port" else x for flag, x in zip(["", *argv], argv, strict=False)]
        variables_here = {k: local(interpolate(v, variables), mounts) for k, v in environment.items()}
        for device in (s.get("deploy") or {}).get("resources", {}).get("reservations", {}).get("devices", []):
            if "device_ids" in device:
                ids = [interpolate(str(i), variables) for i in device["device_ids"]]
                variables_here["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        health = None
        check = (s.get("healthcheck") or {}).get("test")
        if check and check[0] in ("CMD", "CMD-SHELL"):
            health = [local(interpolate(str(x), variables), mounts) for x in check[1:]]
            health = ["sh", "-c", health[0]] if check[0] == "CMD-SHELL" else _executable(health)
        depends = s.get("depends_on") or []
        out.append(Service(n, _executable(argv), variables_here, [d for d in depends if d in chosen], health,
                           _seconds((s.get("healthcheck") or {}).get("start_period", "5m")), named))
    return _ordered(out), foreign


def _ordered(services: list[Service]) -> list[Service]:
    by_name, done, out = {s.name: s for s in services}, set(), []

    def visit(s: Service, path: tuple[str, ...]) -> None:
        if s.name in done:
            return
        if s.name in path:
            raise ValueError(f"depends_on forms a cycle: {' -> '.join((*path, s.name))}")
        for d in s.depends:
            visit(by_name[d], (*path, s.name))
        done.add(s.name)
        out.append(s)

    for s in services:
        visit(s, ())
    return out


def run(services: list[Service], state: Path, cwd: Path) -> int:
    """Start the services in order, each once the ones before it it depends on are healthy; run
    until a signal or until one of them exits; stop them all (newest first)."""
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for folder in {v for s in services for v in s.volumes}:
        Path(folder).mkdir(parents=True, exist_ok=True)
    started: list[tuple[Service, subprocess.Popen[bytes]]] = []
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for s in services:
            try:
                with open(logs / f"{s.name}.log", "ab") as log:
                    proc = subprocess.Popen(s.argv, env={**os.environ, **s.env}, cwd=cwd, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
            except FileNotFoundError:
                print(f"{s.name}: {s.argv[0]} is not installed here", flush=True)
                return 1
            started.append((s, proc))
            print(f"{s.name}: started (pid {proc.pid}, log {logs / s.name}.log): {shlex.join(s.argv)}", flush=True)
            if s.health is not None and not _healthy(s, proc, lambda: stop):
                return 1
        print("all started; Ctrl-C stops them", flush=True)
        while not stop:
            for s, proc in started:
                if proc.poll() is not None:
                    print(f"{s.name}: exited with code {proc.returncode}; stopping the others", flush=True)
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        for _, proc in reversed(started):
            _stop(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _healthy(s: Service, proc: subprocess.Popen[bytes], stopping: Any) -> bool:
    deadline = time.monotonic() + s.start_period_s
    while time.monotonic() < deadline and not stopping():
        if proc.poll() is not None:
            print(f"{s.name}: exited with code {proc.returncode} before it was healthy", flush=True)
            return False
        assert s.health is not None
        try:
            if subprocess.run(s.health, capture_output=True, timeout=30).returncode == 0:
                print(f"{s.name}: healthy", flush=True)
                return True
        except subprocess.TimeoutExpired:
            pass
        time.sleep(1.0)
    if not stopping():
        print(f"{s.name}: not healthy after {s.start_period_s:.0f} s", flush=True)
    return False


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # its whole session: torchrun's ranks too
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
