"""Start the three services as processes on loopback and wait until they serve."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.config import DraftConfig
from gateway.config import GatewayConfig
from specsplit.flags import add_flags, from_args, to_argv
from specsplit.ports import free_port
from specsplit.transport.serving import LAUNCHER_PID_ENV
from specsplit.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.config import TargetConfig

C = TypeVar("C")


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


SERVICES = ("target", "draft", "gateway")


@dataclass
class StackConfig:
    """The services the launcher starts, each described by its own config and started with
    that config's flags (to_argv). Port 0: a free one. The gateway's target and draft
    addresses, the step socket paths and the target's --draft-config (the head's config, for
    its capture layers) are filled in at start."""

    target: TargetConfig = field(default_factory=lambda: TargetConfig(port=0))
    draft: DraftConfig | None = field(default_factory=lambda: DraftConfig(port=0))  # None: no draft service
    gateway: GatewayConfig = field(default_factory=lambda: GatewayConfig(port=0))
    log_dir: Path | None = None  # None: inherit stdout/stderr
    # raw flags after the rendered ones (a later flag wins), for tests and benchmarks
    extra_target_args: list[str] = field(default_factory=list)
    extra_draft_args: list[str] = field(default_factory=list)
    extra_gateway_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to every service's environment
    step_sockets: bool = True  # target and draft also serve Steps on Unix sockets (in a private temp dir)
    gateway_module: str = "gateway"  # benchmarks: bench.replay_gateway

    @classmethod
    def of(cls, *, model: str | None = None, num_steps: int | None = None, draft_device: str | None = None,
           with_draft: bool = True, **settings: Any) -> StackConfig:
        """A stack whose services share settings: each goes to every service config with a field
        of that name (max_context to the target and the draft, head to the draft, max_topk to the
        draft and the gateway, ...), StackConfig's own fields to it. `model` is the target of all
        three, `num_steps` the gateway's default, `draft_device` the draft's device (default:
        `device`). A setting of None keeps the default."""
        own = {f.name for f in fields(cls)} - set(SERVICES)
        stack = {k: settings.pop(k) for k in list(settings) if k in own}
        configs = (TargetConfig(port=0), DraftConfig(port=0), GatewayConfig(port=0))
        target, draft, gateway = configs
        if model is not None:
            settings["model"] = draft.target = model
        for name, value in settings.items():
            if value is None:
                continue
            owners = [c for c in configs if name in {f.name for f in fields(c)}]
            if not owners:
                raise TypeError(f"no service has a setting {name!r}")
            for c in owners:
                setattr(c, name, value)
        if num_steps is not None:
            gateway.default_num_steps = num_steps
        if draft_device is not None:
            draft.device = draft_device
        return cls(target, draft if with_draft else None, gateway, **stack)


def _effective(cfg: C, extra: list[str]) -> C:
    """The config a service gets from `cfg`'s flags followed by `extra` (unknown flags ignored)."""
    p = argparse.ArgumentParser(add_help=False)
    add_flags(p, type(cfg), environment=False)
    return from_args(type(cfg), p.parse_known_args([*to_argv(cfg), *extra])[0])


class ServiceStack:
    """target + draft + gateway, each its own process, on 127.0.0.1."""

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.ports = {"target": cfg.target.port or free_port(),
                      "draft": (cfg.draft.port if cfg.draft is not None else 0) or free_port(),
                      "gateway": cfg.gateway.port or free_port()}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.commands: dict[str, tuple[str, list[str], dict[str, str]]] = {}
        self.socket_dir: str | None = None  # owner-only (mkdtemp), removed by stop()
        self.tls_ca: bytes | None = None  # the gateway's certificate, when it serves TLS

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def stats(self) -> tuple[target_pb2.TargetStats, draft_pb2.DraftStats | None]:
        """The target's and the draft's Stats (None without a draft service)."""
        with grpc.insecure_channel(self.addr("target")) as ch:
            target = target_pb2_grpc.TargetServiceStub(ch).Stats(target_pb2.TargetStatsRequest(), timeout=10)
        if "draft" not in self.procs:
            return target, None
        with grpc.insecure_channel(self.addr("draft")) as ch:
            return target, draft_pb2_grpc.DraftServiceStub(ch).Stats(draft_pb2.DraftStatsRequest(), timeout=10)

    def _spawn(self, name: str, module: str, args: list[str], env: dict[str, str] | None = None
               ) -> subprocess.Popen[bytes]:
        self.commands[name] = (module, args, env or {})
        out = None
        if self.cfg.log_dir is not None:
            self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.cfg.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        # no preexec_fn (unsafe with threads): the service itself asks to die with us (exit_with_launcher)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{LAUNCHER_PID_ENV: str(os.getpid())}, **self.cfg.env,
                   **(env or {}))
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT if out
                                else None, env=env, start_new_session=True)
        self.procs[name] = proc
        return proc

    def _configs(self) -> tuple[TargetConfig, DraftConfig | None, GatewayConfig]:
        """The services' configs as started: ports, addresses, step sockets and the head's config filled in."""
        c = self.cfg
        from specsplit.checkpoints.eagle_head import trained_head_dir  # torch: imported only when starting

        target = replace(c.target, port=self.ports["target"])
        draft = replace(c.draft, port=self.ports["draft"]) if c.draft is not None else None
        head_dir = trained_head_dir(draft.head, draft.target) if draft is not None else None
        if head_dir is not None and _effective(target, c.extra_target_args).draft_config is None:
            target.draft_config = str(head_dir / "config.json")  # the capture layers it reads
        if c.step_sockets:
            if self.socket_dir is None:
                self.socket_dir = tempfile.mkdtemp(prefix="specsplit-")
            target.step_socket = os.path.join(self.socket_dir, "target.sock")
            if draft is not None:
                draft.step_socket = os.path.join(self.socket_dir, "draft.sock")
        gateway = replace(c.gateway, port=self.ports["gateway"], target_addr=self.addr("target"),
                          draft_addr=self.addr("draft") if draft is not None else "")
        return target, draft, gateway

    def start(self, timeout: float = 300.0) -> ServiceStack:
        c = self.cfg
        target, draft, gateway = self._configs()
        self._spawn("target", "target_service", [*to_argv(target), *c.extra_target_args])
        if draft is not None:
            self._spawn("draft", "draft_service", [*to_argv(draft), *c.extra_draft_args])
        try:
            wait_serving(self.addr("target"), self.procs["target"], timeout, "target_service")
            if draft is not None:
                wait_serving(self.addr("draft"), self.procs["draft"], timeout, "draft_service")
            secret = {"SPECSPLIT_AUTH_TOKEN": gateway.auth_token} if gateway.auth_token else None
            self._spawn("gateway", c.gateway_module, [*to_argv(gateway), *c.extra_gateway_args], secret)
            tls_cert = _effective(gateway, c.extra_gateway_args).tls_cert
            self.tls_ca = Path(tls_cert).read_bytes() if tls_cert else None
            wait_serving(self.addr("gateway"), self.procs["gateway"], timeout, "gateway", self.tls_ca)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def signal(self, name: str, sig: signal.Signals) -> None:
        """Send a running service (its whole process group) a signal: SIGSTOP and SIGCONT stall and
        resume it, SIGTERM stops it gracefully (then `wait`)."""
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, sig)

    def wait(self, name: str, timeout: float = 30.0) -> int:
        """Wait for a service to exit; its exit code."""
        return self.procs[name].wait(timeout)

    def restart(self, name: str, timeout: float = 300.0) -> None:
        """Start a killed service again with its original command, and wait until it serves."""
        self.kill(name)
        module, args, env = self.commands[name]
        wait_serving(self.addr(name), self._spawn(name, module, args, env), timeout, name,
                     self.tls_ca if name == "gateway" else None)

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
