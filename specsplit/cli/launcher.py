"""Start the three services as processes on loopback and wait until they serve."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.transport.serving import LAUNCHER_PID_ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(addr: str, proc: subprocess.Popen[bytes] | None, timeout: float, name: str,
                 tls_ca: bytes | None = None) -> None:
    deadline = time.monotonic() + timeout
    channel = (grpc.secure_channel(addr, grpc.ssl_channel_credentials(tls_ca),
                                   options=[("grpc.ssl_target_name_override", "localhost")])
               if tls_ca is not None else grpc.insecure_channel(addr))
    with channel as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} before serving")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{name} at {addr} not serving after {timeout:.0f} s")


@dataclass
class StackConfig:
    model: str = "smollm2"
    head: str = "default"  # see specsplit.checkpoints.eagle_head.resolve_head_dir
    dtype: str = "float32"
    tp_size: int = 1
    num_steps: int = 4
    max_context: int = 2048
    max_sequences: int = 8
    hidden_backend: str = "shm"
    device: str | None = None  # the target's --device (None: its default, the CPU); `cuda` puts rank r on GPU r
    draft_device: str | None = None  # the draft's --device (None: `device`)
    target_port: int = 0  # 0: a free port
    draft_port: int = 0
    gateway_port: int = 0
    with_draft: bool = True
    threads: int = 0
    log_dir: Path | None = None  # None: inherit stdout/stderr
    extra_target_args: list[str] = field(default_factory=list)
    extra_draft_args: list[str] = field(default_factory=list)
    extra_gateway_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to every service's environment
    gateway_tls: bool = False  # the gateway serves TLS (its --tls-cert is also the CA to trust)
    step_sockets: bool = True  # the gateway's Steps over Unix sockets (in a private temp dir), not gRPC streams
    gateway_module: str = "gateway"  # benchmarks: bench.replay_gateway


class ServiceStack:
    """target + draft + gateway, each its own process, on 127.0.0.1."""

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.ports = {"target": cfg.target_port or free_port(), "draft": cfg.draft_port or free_port(),
                      "gateway": cfg.gateway_port or free_port()}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.commands: dict[str, tuple[str, list[str]]] = {}
        self.socket_dir: str | None = None  # owner-only (mkdtemp), removed by stop()

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def _spawn(self, name: str, module: str, args: list[str]) -> subprocess.Popen[bytes]:
        self.commands[name] = (module, args)
        out = None
        if self.cfg.log_dir is not None:
            self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.cfg.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        # no preexec_fn (unsafe with threads): the service itself asks to die with us (exit_with_launcher)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{LAUNCHER_PID_ENV: str(os.getpid())}, **self.cfg.env)
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT if out
                                else None, env=env, start_new_session=True)
        self.procs[name] = proc
        return proc

    def start(self, timeout: float = 300.0) -> ServiceStack:
        c = self.cfg
        from specsplit.checkpoints.eagle_head import trained_head_dir  # torch: imported only when starting

        head_dir = trained_head_dir(c.head, c.model) if c.with_draft else None
        if head_dir is not None and "--draft-config" not in c.extra_target_args:  # the capture layers it reads
            c.extra_target_args = [*c.extra_target_args, "--draft-config", str(head_dir / "config.json")]
        common = ["--dtype", c.dtype, "--max-context", str(c.max_context), "--max-sequences", str(c.max_sequences),
                  "--threads", str(c.threads)]
        target_device = ["--device", c.device] if c.device else []
        draft_device = ["--device", c.draft_device or c.device] if c.draft_device or c.device else []
        target_socket, draft_socket = [], []
        if c.step_sockets:
            self.socket_dir = tempfile.mkdtemp(prefix="specsplit-")
            target_socket = ["--step-socket", os.path.join(self.socket_dir, "target.sock")]
            draft_socket = ["--step-socket", os.path.join(self.socket_dir, "draft.sock")]
        self._spawn("target", "target_service", ["--model", c.model, "--tp-size", str(c.tp_size), "--port",
                                                 str(self.ports["target"]), "--hidden-backend", c.hidden_backend,
                                                 *target_device, *common, *target_socket, *c.extra_target_args])
        if c.with_draft:
            self._spawn("draft", "draft_service", ["--head", c.head, "--target", c.model, "--port",
                                                   str(self.ports["draft"]), *common, *draft_device,
                                                   *draft_socket, *c.extra_draft_args])
        try:
            wait_serving(self.addr("target"), self.procs["target"], timeout, "target_service")
            if c.with_draft:
                wait_serving(self.addr("draft"), self.procs["draft"], timeout, "draft_service")
            self._spawn("gateway", c.gateway_module, ["--target", self.addr("target"),
                                               "--draft", self.addr("draft") if c.with_draft else "",
                                               "--model", c.model, "--port", str(self.ports["gateway"]),
                                               "--num-steps", str(c.num_steps), *c.extra_gateway_args])
            ca = None
            if c.gateway_tls:
                ca = Path(c.extra_gateway_args[c.extra_gateway_args.index("--tls-cert") + 1]).read_bytes()
            wait_serving(self.addr("gateway"), self.procs["gateway"], timeout, "gateway", ca)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def restart(self, name: str, timeout: float = 300.0) -> None:
        """Start a killed service again with its original command, and wait until it serves."""
        self.kill(name)
        module, args = self.commands[name]
        wait_serving(self.addr(name), self._spawn(name, module, args), timeout, name)

    def stop(self) -> None:
        """Gateway first (it closes its streams), then draft and target."""
        for name in ("gateway", "draft", "target"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.socket_dir = None

    def __enter__(self) -> ServiceStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
