"""specsplit: run the services and talk to them.

  specsplit up          start target, draft and gateway on loopback until Ctrl-C
  specsplit generate    stream a generation from a running gateway
  specsplit demo        up + one streamed generation + a summary line, then down
  specsplit health      one grpc.health.v1 check of a service (exit 0 when SERVING): container health checks
  specsplit make-random-head / make-tiny-target   checkpoints for tests
  specsplit train-head  train an EAGLE-3 head by self-distillation (docs/training.md)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

DEFAULT_PROMPT = "Write a short Python function that checks whether a number is prime."


def _stack_args(p: argparse.ArgumentParser) -> None:
    """The stack's settings, with the flags, defaults and help of the services' own configs."""
    from draft_service.config import DraftConfig
    from gateway.config import GatewayConfig
    from specsplit.flags import add_flags
    from target_service.config import TargetConfig

    add_flags(p, TargetConfig, only=("model", "tp_size", "max_context", "max_sequences"), environment=False)
    add_flags(p, DraftConfig, only=("head",), environment=False)
    add_flags(p, GatewayConfig, only=("default_num_steps", "step_timeout_s", "draft_timeout_s", "liveness_timeout_s",
                                      "lease_s", "shutdown_grace_s"), environment=False)
    for name, cls in (("gateway", GatewayConfig), ("target", TargetConfig), ("draft", DraftConfig)):
        add_flags(p, cls, only=("port",), names={"port": f"--{name}-port"}, prefix=f"{name}_", label=name,
                  environment=False)
    p.add_argument("--no-draft", action="store_true", help="start no draft service")
    p.add_argument("--log-dir", default=None, help="write service logs here instead of the terminal")


def _gen_args(p: argparse.ArgumentParser, per_request_steps: bool = True) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None)
    if per_request_steps:
        p.add_argument("--num-steps", dest="gen_num_steps", type=int, default=None, help="draft steps per cycle")
        p.add_argument("--topk", dest="gen_topk", type=int, default=None,
                       help="> 1: draft a tree branching topk ways (greedy only); 1: a chain")
        p.add_argument("--num-draft-tokens", dest="gen_num_draft_tokens", type=int, default=None,
                       help="a tree's size counting the root")
    p.add_argument("--no-spec", action="store_true", help="speculation off: target-only decoding")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="no chat template")


def _stack(a: argparse.Namespace):  # noqa: ANN202
    from specsplit.cli.launcher import ServiceStack, StackConfig

    cfg = StackConfig.of(model=a.model, head=a.head, tp_size=a.tp_size, num_steps=a.default_num_steps,
                         max_context=a.max_context, max_sequences=a.max_sequences, with_draft=not a.no_draft,
                         log_dir=Path(a.log_dir) if a.log_dir else None, step_timeout_s=a.step_timeout_s,
                         draft_timeout_s=a.draft_timeout_s, liveness_timeout_s=a.liveness_timeout_s,
                         lease_s=a.lease_s, shutdown_grace_s=a.shutdown_grace_s)
    cfg.target.port, cfg.gateway.port = a.target_port, a.gateway_port
    if cfg.draft is not None:
        cfg.draft.port = a.draft_port
    return ServiceStack(cfg)


def _request(a: argparse.Namespace, prompt: str, speculation: bool | None = None):  # noqa: ANN202
    from specsplit.cli.client import make_request

    spec = False if a.no_spec else speculation
    return make_request(prompt, raw=a.raw, max_new_tokens=a.max_new_tokens, num_steps=getattr(a, "gen_num_steps", None),
                        speculation=spec, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                        topk=getattr(a, "gen_topk", None), num_draft_tokens=getattr(a, "gen_num_draft_tokens", None))


def _summary_line(s: dict) -> str:
    tree = f", tree topk {s['topk']} of {s['num_draft_tokens']}" if s.get("topk", 1) > 1 else ""
    spec = f"speculation {s['num_steps']} steps{tree}" if s["speculation"] else "speculation off"
    if s["speculation"] and s.get("adaptive"):  # cycles by the steps chosen for them
        chosen = ", ".join(f"{k}: {n}" for k, n in enumerate(s["num_steps_histogram"]) if n)
        spec = f"speculation, steps chosen per cycle ({chosen}){tree}"
    ahead = s.get("draft_ahead_hits", 0) + s.get("draft_ahead_misses", 0)
    if ahead:  # drafting ahead: how often the next cycle's drafts were ready
        spec += f", drafted ahead {s['draft_ahead_hits']} hits of {ahead}"
    return (f"[{spec}] {s['completion_tokens']} tokens in {s['elapsed_ms'] / 1e3:.2f} s = "
            f"{s['tokens_per_s']:.1f} tok/s | cycles {s['cycles']} | mean accepted length "
            f"{s['mean_accepted_length']:.2f} | draft {s['draft_ms']:.0f} ms, verify {s['verify_ms']:.0f} ms | "
            f"finish {s['finish_reason']}")


def _stream(addr: str, req, as_json: bool, token: str | None = None, tls_ca: bytes | None = None) -> dict:  # noqa: ANN001
    from specsplit.cli.client import GatewayClient

    client = GatewayClient(addr, token=token, tls_ca=tls_ca)
    try:
        def show(msg) -> None:  # noqa: ANN001
            if not as_json and msg.text:
                sys.stdout.write(msg.text)
                sys.stdout.flush()

        gen = client.generate(req, on_chunk=show)
    finally:
        client.close()
    if not as_json:
        sys.stdout.write("\n")
    return gen.summary()


def cmd_up(a: argparse.Namespace) -> int:
    stack = _stack(a)
    print("starting target, draft and gateway (first start converts the model, ~10 s) ...", flush=True)
    stack.start()
    print(f"gateway {stack.addr('gateway')} | target {stack.addr('target')} | draft {stack.addr('draft')}"
          " | Ctrl-C stops", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        stack.stop()
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    import os

    import grpc

    token = Path(a.token_file).read_text().strip() if a.token_file else os.environ.get("SPECSPLIT_AUTH_TOKEN")
    tls_ca = Path(a.tls_ca).read_bytes() if a.tls_ca else None
    try:
        summary = _stream(a.addr, _request(a, a.prompt or DEFAULT_PROMPT), a.json, token, tls_ca)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(json.dumps(summary) if a.json else _summary_line(summary))
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    a.raw = False
    stack = _stack(a)
    t0 = time.perf_counter()
    print("starting target, draft and gateway on loopback (first start converts the model, ~10 s) ...", flush=True)
    with stack:
        print(f"services up in {time.perf_counter() - t0:.1f} s: gateway {stack.addr('gateway')}", flush=True)
        prompt = a.prompt or DEFAULT_PROMPT
        print(f"\nprompt: {prompt}\n--- streamed (speculative) ---", flush=True)
        spec = _stream(stack.addr("gateway"), _request(a, prompt, speculation=True), False)
        base = _stream(stack.addr("gateway"), _request(a, prompt, speculation=False), True)
    print("--- summary ---")
    print(_summary_line(spec))
    print(_summary_line(base))
    same = "identical" if spec["token_ids"] == base["token_ids"] else "DIFFERENT"
    ratio = spec["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
    print(f"speculative vs target-only: {ratio:.2f}x tokens/s, outputs {same}")
    return 0 if same == "identical" or (a.temperature or 0) > 0 else 1


def cmd_health(a: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(a.addr) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=a.service),
                                                              timeout=a.timeout)
        except grpc.RpcError as e:
            print(f"{a.addr}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{a.addr} {a.service or '(server)'}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_random_head(a: argparse.Namespace) -> int:
    from specsplit.checkpoints.eagle_head import random_head, save_head
    from specsplit.checkpoints.target_checkpoint import load_target_config, resolve_target_dir

    aux = [int(x) for x in a.aux_layer_ids.split(",")] if a.aux_layer_ids else None
    cfg, weights = random_head(load_target_config(resolve_target_dir(a.target)), a.draft_vocab, a.seed,
                               aux_layer_ids=aux)
    save_head(a.out, cfg, weights)
    print(f"wrote a random EAGLE-3 head ({cfg.draft_vocab_size} draft tokens) to {a.out}")
    return 0


def cmd_tiny_target(a: argparse.Namespace) -> int:
    from specsplit.checkpoints.tiny import write_tiny_target

    print(f"wrote a tiny random Llama to {write_tiny_target(a.out, seed=a.seed)}")
    return 0


def cmd_trace_report(a: argparse.Namespace) -> int:
    from specsplit.observability import trace_report as tr

    if a.listen:
        spans = tr.receive_otlp(a.listen, a.duration, a.idle)
    elif a.paths:
        spans = tr.load_jsonl(a.paths)
    else:
        print("error: give span files/folders or --listen HOST:PORT", file=sys.stderr)
        return 2
    requests = tr.analyze(spans)
    if not requests:
        print(f"error: no request spans among {len(spans)} spans", file=sys.stderr)
        return 1
    s = tr.summary(requests)
    print(json.dumps(s) if a.json else tr.format_text(s))
    if a.png:
        tr.plot(requests, a.png)
        print(f"wrote {a.png}", file=sys.stderr)
    return 0


def cmd_compose_local(a: argparse.Namespace) -> int:
    from specsplit.cli import compose_local

    compose = Path(a.file).resolve()
    profiles = a.profile or [p for p in os.environ.get("COMPOSE_PROFILES", compose_local.dot_env(
        compose.parent / ".env").get("COMPOSE_PROFILES", "")).split(",") if p]
    state = Path(a.state).resolve()
    try:
        services, foreign = compose_local.plan(compose, profiles, state, [n for n in a.services.split(",") if n],
                                               free_ports=a.free_ports, bind_all=a.bind_all)
    except ValueError as e:
        print(f"specsplit compose-local: {e}", file=sys.stderr)
        return 2
    for name in foreign:
        print(f"{name}: an image not built from this repository, not run here", file=sys.stderr)
    if a.dry_run:
        for s in services:
            print(json.dumps({"service": s.name, "argv": s.argv, "env": s.env, "depends_on": s.depends,
                              "healthcheck": s.health}))
        return 0
    return compose_local.run(services, state, compose.parent)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specsplit", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the services until interrupted")
    _stack_args(up)
    gen = sub.add_parser("generate", help="stream a generation")
    gen.add_argument("prompt", nargs="?", default=None)
    gen.add_argument("--addr", default="127.0.0.1:50051")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.add_argument("--token-file", default=None, help="bearer token file (or SPECSPLIT_AUTH_TOKEN)")
    gen.add_argument("--tls-ca", default=None, help="PEM roots to trust: connect with TLS")
    _gen_args(gen)
    demo = sub.add_parser("demo", help="services up, one streamed generation, a summary, down")
    demo.add_argument("prompt", nargs="?", default=None)
    _stack_args(demo)
    _gen_args(demo, per_request_steps=False)
    hc = sub.add_parser("health", help="one grpc.health.v1 check; exit 0 when SERVING")
    hc.add_argument("addr", help="HOST:PORT of a specsplit service (plaintext)")
    hc.add_argument("--service", default="", help="service name, e.g. specsplit.v1.TargetService ('' = the server)")
    hc.add_argument("--timeout", type=float, default=3.0)
    rh = sub.add_parser("make-random-head", help="write a randomly initialised EAGLE-3 head for a target")
    rh.add_argument("--target", default="smollm2")
    rh.add_argument("--out", required=True)
    rh.add_argument("--draft-vocab", type=int, default=8192)
    rh.add_argument("--seed", type=int, default=0)
    rh.add_argument("--aux-layer-ids", default=None)
    tt = sub.add_parser("make-tiny-target", help="write a tiny random Llama target")
    tt.add_argument("--out", required=True)
    tt.add_argument("--seed", type=int, default=0)
    from specsplit.training.cli import add_parser as add_train_head

    add_train_head(sub)
    tr = sub.add_parser("trace", help="trace tools").add_subparsers(dest="trace_cmd", required=True)
    rep = tr.add_parser("report", help="cycle-time percentiles, accepted lengths, tokens/s and a PNG timeline")
    rep.add_argument("paths", nargs="*", help="*.spans.jsonl files or folders holding them")
    rep.add_argument("--listen", default=None, help="receive OTLP/gRPC spans on HOST:PORT instead")
    rep.add_argument("--duration", type=float, default=60.0, help="seconds to listen")
    rep.add_argument("--idle", type=float, default=0.0, help="stop listening after this many quiet seconds")
    rep.add_argument("--png", default="trace_timeline.png", help="timeline image ('' for none)")
    rep.add_argument("--json", action="store_true")
    cl = sub.add_parser("compose-local", help="docker-compose.yml's services as processes on this host, no Docker")
    cl.add_argument("--file", default="docker-compose.yml")
    cl.add_argument("--profile", action="append", help="a compose profile (repeatable; default: COMPOSE_PROFILES, "
                    "from the environment or the compose file's .env)")
    cl.add_argument("--services", default="", help="comma list: only these (default: all of the profiles')")
    cl.add_argument("--state", default=".compose-local", help="named volumes' folders and the services' logs")
    cl.add_argument("--free-ports", action="store_true", help="move each service's --port to a free one")
    cl.add_argument("--bind-all", action="store_true", help="keep 0.0.0.0 (default: loopback)")
    cl.add_argument("--dry-run", action="store_true", help="print each service's argv and environment (JSON lines)")
    a = p.parse_args(argv)
    from specsplit.training.cli import run as cmd_train_head

    handlers = {"up": cmd_up, "generate": cmd_generate, "demo": cmd_demo, "health": cmd_health,
                "make-random-head": cmd_random_head, "make-tiny-target": cmd_tiny_target,
                "trace": cmd_trace_report, "train-head": cmd_train_head, "compose-local": cmd_compose_local}
    return handlers[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
