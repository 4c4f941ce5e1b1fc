"""Each service's flags come from its config dataclass: a flag for every field, a config
renders into flags that parse back into it, and the flags keep their behaviours (switches,
comma lists, environment defaults, the token file, configuration errors without a traceback)."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from draft_service.__main__ import build_parser as draft_parser
from draft_service.__main__ import parse_args as draft_args
from draft_service.config import DraftConfig
from gateway.__main__ import build_parser as gateway_parser
from gateway.__main__ import parse_args as gateway_args
from gateway.config import GatewayConfig
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.flags import flag_of, from_args, to_argv
from target_service.__main__ import build_parser as target_parser
from target_service.__main__ import parse_args as target_args
from target_service.config import TargetConfig

SERVICES: list[tuple[type, Callable[[], argparse.ArgumentParser]]] = [
    (TargetConfig, target_parser), (DraftConfig, draft_parser), (GatewayConfig, gateway_parser)]
ENV = ["SPECSPLIT_MODEL", "SPECSPLIT_HEAD", "SPECSPLIT_DRAFT_CONFIG", "SPECSPLIT_TARGET_STEP_SOCKET",
       "SPECSPLIT_DRAFT_STEP_SOCKET", "SPECSPLIT_TARGET_ADDR", "SPECSPLIT_DRAFT_ADDR", "SPECSPLIT_TLS_CERT",
       "SPECSPLIT_TLS_KEY", "SPECSPLIT_AUTH_TOKEN"]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def changed(cls: type) -> Any:
    """A config of `cls` with every field away from its default."""
    hints, values = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        spec, tp = flag_of(f), hints[f.name]
        assert spec is not None
        if spec.choices:
            values[f.name] = next(c for c in reversed(spec.choices) if c != f.default)
        elif tp is bool:
            values[f.name] = not f.default
        elif tp in (int, float):
            values[f.name] = f.default + 3
        elif tp is str:
            values[f.name] = f"-{f.name}, with spaces"  # a leading dash, a comma
        elif tp == str | None:
            values[f.name] = f"{f.name}.json"
        else:
            values[f.name] = [1, 2, 3]
    return cls(**values)


@pytest.mark.parametrize("cls, build", SERVICES)
def test_every_config_field_has_a_flag_in_its_service_parser(cls: type, build: Callable) -> None:
    options = {o for action in build()._actions for o in action.option_strings}
    for f in dataclasses.fields(cls):
        spec = flag_of(f)
        assert spec is not None, f"{cls.__name__}.{f.name} has no flag"
        assert spec.name in options, f"{cls.__name__}.{f.name}: {spec.name} missing from the parser"


@pytest.mark.parametrize("cls, build", SERVICES)
def test_to_argv_round_trips_through_the_parser(cls: type, build: Callable, clean_env: pytest.MonkeyPatch) -> None:
    for name in ENV:  # a flag beats its environment variable: the rendering holds against any environment
        clean_env.setenv(name, "from-the-environment")
    for cfg in (changed(cls), cls()):
        if cls is GatewayConfig:
            cfg.auth_token = "from-the-environment"  # a secret travels in the environment, never as a flag
        argv = to_argv(cfg)
        assert not any("from-the-environment" in a for a in argv)
        assert from_args(cls, build().parse_args(argv)) == cfg


def test_to_argv_keeps_only_what_a_parser_would_not_give(clean_env: pytest.MonkeyPatch) -> None:
    assert to_argv(DraftConfig()) == ["--head=default", "--target=smollm2", "--step-socket="]
    argv = to_argv(TargetConfig(max_context=512, aux_layer_ids=[1, 2], engine_thread=False, cuda_graphs=False))
    assert argv == ["--model=smollm2", "--max-context=512", "--aux-layer-ids=1,2", "--draft-config=",
                    "--inline-steps", "--no-cuda-graphs", "--step-socket="]


def test_service_flags_keep_their_behaviours(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    t = target_args(["--inline-steps", "--no-cuda-graphs", "--compile", "--aux-layer-ids", "1,2,3"])
    assert (t.engine_thread, t.cuda_graphs, t.compile, t.aux_layer_ids) == (False, False, True, [1, 2, 3])
    assert target_args([]).ring_rows == 2 * TargetConfig().max_context
    clean_env.setenv("SPECSPLIT_MODEL", "some-model")
    clean_env.setenv("SPECSPLIT_DRAFT_CONFIG", "")  # compose sets it empty: no draft config
    clean_env.setenv("SPECSPLIT_HEAD", "random")
    clean_env.setenv("SPECSPLIT_DRAFT_ADDR", "")  # target-only
    assert (target_args([]).model, target_args([]).draft_config) == ("some-model", None)
    assert (draft_args([]).head, draft_args([]).target) == ("random", "some-model")
    assert target_args(["--model", "flag-model"]).model == "flag-model"
    g = gateway_args(["--no-step-sockets", "--no-loop-thread", "--step-timeout", "2.5", "--num-steps", "2"])
    assert (g.model, g.draft_addr, g.step_sockets, g.loop_thread, g.step_timeout_s, g.default_num_steps) == \
        ("some-model", "", False, False, 2.5, 2)
    token = tmp_path / "token"
    token.write_text("  sekrit\n")
    assert gateway_args(["--auth-token-file", str(token)]).auth_token == "sekrit"
    clean_env.setenv("SPECSPLIT_AUTH_TOKEN", "from-env")
    assert gateway_args([]).auth_token == "from-env"
    assert gateway_args(["--auth-token-file", str(token)]).auth_token == "sekrit"
    token.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        gateway_args(["--auth-token-file", str(token)])


@pytest.mark.parametrize("module, argv, message", [
    ("gateway", ["--num-steps", "99"], "gateway: configuration error: default_num_steps must be within"),
    ("target_service", ["--port", "0"], "target_service: configuration error: port 0 out of range"),
    ("target_service", ["--few-rows", "9"], "target_service: configuration error: few_rows 9 not within"),
    ("draft_service", ["--max-topk", "0"], "draft_service: configuration error: max_topk must be >= 1"),
    ("draft_service", ["--fused-head", "on"], "draft_service: configuration error: fused_head on needs a CUDA"),
    ("draft_service", ["--fused-head", "on", "--device", "cuda", "--compile"],
     "draft_service: configuration error: fused_head on and compile exclude each other"),
])
def test_a_configuration_error_exits_without_a_traceback(module: str, argv: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_stack_settings_go_to_every_service_that_has_them() -> None:
    cfg = StackConfig.of(model="m", head="h", max_context=512, max_topk=4, num_steps=2, device="cuda",
                         draft_device="cuda:1", tls_cert="c", dtype=None, log_dir=Path("logs"))
    assert cfg.draft is not None and cfg.log_dir == Path("logs")
    assert (cfg.target.model, cfg.draft.target, cfg.gateway.model, cfg.draft.head) == ("m", "m", "m", "h")
    assert (cfg.target.max_context, cfg.draft.max_context, cfg.draft.max_topk, cfg.gateway.max_topk) == \
        (512, 512, 4, 4)
    assert (cfg.gateway.default_num_steps, cfg.target.device, cfg.draft.device) == (2, "cuda", "cuda:1")
    assert cfg.gateway.tls_cert == "c" and cfg.target.dtype == "float32"
    assert (cfg.target.port, cfg.draft.port, cfg.gateway.port) == (0, 0, 0)  # free ones at start
    assert StackConfig.of(with_draft=False).draft is None
    with pytest.raises(TypeError, match="no_such_setting"):
        StackConfig.of(no_such_setting=1)


def test_the_launcher_starts_each_service_with_its_config_as_flags(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SPECSPLIT_TARGET_ADDR", "elsewhere:1")  # rendered flags beat the environment
    stack = ServiceStack(StackConfig.of(model="smollm2", head="default", max_context=512, num_steps=3))
    try:
        target, draft, gateway = stack._configs()
        assert draft is not None and stack.socket_dir is not None
        assert target.draft_config is not None and target.draft_config.endswith("config.json")  # the head's layers
        assert target.step_socket == str(Path(stack.socket_dir) / "target.sock")
        assert (gateway.target_addr, gateway.draft_addr) == (stack.addr("target"), stack.addr("draft"))
        for cfg, build in zip((target, draft, gateway), (target_parser, draft_parser, gateway_parser), strict=True):
            assert from_args(type(cfg), build().parse_args(to_argv(cfg))) == cfg
    finally:
        stack.stop()
    kept = ServiceStack(StackConfig.of(head="default", step_sockets=False, extra_target_args=["--draft-config=x"]))
    target, _, _ = kept._configs()
    assert target.draft_config is None and target.step_socket == "" and kept.socket_dir is None
