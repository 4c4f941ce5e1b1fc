"""python -m gateway: the public API; drives the draft -> verify loop."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc

from gateway.clients import DraftClient, GrpcDraft, GrpcTarget
from gateway.config import GatewayConfig
from gateway.loop_thread import LoopThread
from gateway.observe import GatewayMetrics
from gateway.recovery import Recovery
from gateway.requests import ModelLimits
from gateway.scheduler import Scheduler
from gateway.security import BearerTokenInterceptor, read_token, server_credentials
from gateway.server import GatewayServicer
from gateway.sglang_scheduler import SglangSchedulerServicer, WorkerModel
from specsplit.checkpoints.target_checkpoint import resolve_target_dir
from specsplit.observability.telemetry import Telemetry, setup_telemetry
from specsplit.tokenizer import TextCodec
from specsplit.transport.serving import (
    configure_logging,
    exit_with_launcher,
    install_uvloop,
    log,
    new_server,
    serve_until_signal,
    set_serving,
)
from specsplit.transport.step_socket import resolve_spin_s
from specsplit.v1 import gateway_pb2_grpc, target_pb2

T = TypeVar("T")


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    d = GatewayConfig()
    p = argparse.ArgumentParser(prog="gateway", description=__doc__)
    p.add_argument("--target", default=os.environ.get("SPECSPLIT_TARGET_ADDR", d.target_addr))
    p.add_argument("--draft", default=os.environ.get("SPECSPLIT_DRAFT_ADDR", d.draft_addr),
                   help="draft service address; empty for target-only decoding")
    p.add_argument("--model", default=os.environ.get("SPECSPLIT_MODEL", d.model))
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--num-steps", type=int, default=d.default_num_steps)
    p.add_argument("--max-num-steps", type=int, default=d.max_num_steps)
    p.add_argument("--topk", type=int, default=d.default_topk,
                   help="default tree branching for greedy requests (1: chain drafts)")
    p.add_argument("--max-topk", type=int, default=d.max_topk)
    p.add_argument("--num-draft-tokens", type=int, default=d.default_num_draft_tokens,
                   help="default tree size counting the root (trees only)")
    p.add_argument("--max-num-draft-tokens", type=int, default=d.max_num_draft_tokens)
    p.add_argument("--max-new-tokens", type=int, default=d.default_max_new_tokens)
    p.add_argument("--max-new-tokens-cap", type=int, default=d.max_new_tokens_cap)
    p.add_argument("--max-queue", type=int, default=d.max_queue)
    p.add_argument("--max-streams", type=int, default=d.max_streams)
    p.add_argument("--stream-interval", type=int, default=d.stream_interval,
                   help="tokens gathered per streamed message after the first one (1: every cycle's tokens at once)")
    p.add_argument("--step-timeout", type=float, default=d.step_timeout_s,
                   help="seconds: a draft step slower than this suspends speculation (streams go on target-only), "
                        "a target step slower than this ends the streams with UNAVAILABLE")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars)
    p.add_argument("--tls-cert", default=os.environ.get("SPECSPLIT_TLS_CERT", ""))
    p.add_argument("--tls-key", default=os.environ.get("SPECSPLIT_TLS_KEY", ""))
    p.add_argument("--no-step-sockets", dest="step_sockets", action="store_false",
                   help="always send Steps over the gRPC streams, even where a service offers a Unix step socket")
    p.add_argument("--no-loop-thread", dest="loop_thread", action="store_false",
                   help="run the speculation loop on the server's event loop instead of a thread of its own "
                        "(whose step sockets are read blocking)")
    p.add_argument("--step-spin-us", type=float, default=d.step_spin_us,
                   help="with the loop thread: poll a step socket this many µs for the reply before a blocking read "
                        "(no wake-up from idle when the reply comes; 0: block at once; default: 20000 when the target "
                        "hands hidden states over CUDA IPC, else 0)")
    p.add_argument("--auth-token-file", default=None, help="file holding the bearer token (or SPECSPLIT_AUTH_TOKEN)")
    a = p.parse_args(argv)
    return GatewayConfig(target_addr=a.target, draft_addr=a.draft, model=a.model, host=a.host, port=a.port,
                         default_num_steps=a.num_steps, max_num_steps=a.max_num_steps,
                         default_topk=a.topk, max_topk=a.max_topk, default_num_draft_tokens=a.num_draft_tokens,
                         max_num_draft_tokens=a.max_num_draft_tokens,
                         default_max_new_tokens=a.max_new_tokens, max_new_tokens_cap=a.max_new_tokens_cap,
                         max_queue=a.max_queue, max_streams=a.max_streams, stream_interval=a.stream_interval,
                         step_timeout_s=a.step_timeout,
                         max_prompt_tokens=a.max_prompt_tokens,
                         max_prompt_chars=a.max_prompt_chars, tls_cert=a.tls_cert, tls_key=a.tls_key,
                         step_sockets=a.step_sockets, loop_thread=a.loop_thread, step_spin_us=a.step_spin_us,
                         auth_token=read_token(a.auth_token_file, os.environ.get("SPECSPLIT_AUTH_TOKEN"))).validate()


@dataclass
class DraftWrap:
    """A hook for benchmarks (bench.replay_gateway): the loop's draft client replaced by
    `wrap(client, vocab_size)`, its name in ModelInfo followed by `label`."""

    wrap: Callable[[DraftClient, int], DraftClient]
    label: str


@dataclass
class Backend:
    """The gateway's side of the services: their clients, the speculation loop and the
    recovery task, all on one event loop (the loop thread's, by default)."""

    info: target_pb2.TargetInfo
    target: GrpcTarget
    draft: GrpcDraft | None
    scheduler: Scheduler
    recovery: Recovery

    async def stop(self) -> None:
        await self.recovery.stop()
        await self.scheduler.stop()
        for client in (self.target, self.draft):
            if client is not None:
                await client.close()


async def connect(cfg: GatewayConfig, telemetry: Telemetry, on_target_state: Callable[[bool], None],
                  draft_wrap: DraftWrap | None = None) -> Backend:
    """Reach both services and start the loop, on the event loop that will run it."""
    target = GrpcTarget(cfg.target_addr)
    info = await target.describe(timeout=300.0)
    # on the loop thread the step sockets are read blocking: (timeout, spin before blocking)
    on_gpu = info.hidden_store.HasField("device") and info.hidden_store.device >= 0
    blocking = (cfg.step_timeout_s, resolve_spin_s(cfg.step_spin_us, on_gpu)) if cfg.loop_thread else None
    target.blocking = blocking
    log.info("target steps over %s", target.use_step_transport(info.step_socket if cfg.step_sockets else ""))
    draft = GrpcDraft(cfg.draft_addr, blocking) if cfg.draft_addr else None
    loop_draft: DraftClient | None = draft
    if draft is not None and draft_wrap is not None:
        loop_draft = draft_wrap.wrap(draft, info.vocab_size)
        log.warning("benchmark mode: the draft's proposals are %s", draft_wrap.label)
    scheduler = Scheduler(target, loop_draft, info.max_sequences, cfg.max_queue, telemetry.tracer,
                          GatewayMetrics.create(telemetry.meter), cfg.step_timeout_s)
    scheduler.on_target_state.append(on_target_state)
    recovery = Recovery(scheduler, target, draft, info.hidden_store, list(info.aux_layer_ids), cfg.max_num_steps,
                        cfg.draft_retry_s, cfg.step_sockets, cfg.max_topk)
    if draft is not None:
        if await recovery.attach_draft():
            scheduler.draft_restored()
        else:
            log.warning("draft service not usable yet: target-only decoding until it attaches")
    scheduler.start()
    recovery.start()
    return Backend(info, target, draft, scheduler, recovery)


async def serve(cfg: GatewayConfig, draft_wrap: DraftWrap | None = None) -> None:
    model_dir = resolve_target_dir(cfg.model)
    codec = TextCodec.from_checkpoint(model_dir)
    telemetry = setup_telemetry("specsplit-gateway")
    server, health = new_server([BearerTokenInterceptor(cfg.auth_token)] if cfg.auth_token else None)
    loop = asyncio.get_running_loop()

    def on_target_state(up: bool) -> None:  # called on the speculation loop's thread
        loop.call_soon_threadsafe(lambda: loop.create_task(set_serving(health, ["specsplit.v1.Gateway"], up)))

    loop_thread = LoopThread("spec-loop").start() if cfg.loop_thread else None

    async def on_backend(coro: Coroutine[Any, Any, T]) -> T:
        return await (loop_thread.run(coro) if loop_thread is not None else coro)

    backend = await on_backend(connect(cfg, telemetry, on_target_state, draft_wrap))
    info, scheduler = backend.info, backend.scheduler
    limits = ModelLimits(info.vocab_size, info.max_context, list(info.eos_token_ids), backend.draft is not None,
                         cfg.max_prompt_tokens, info.max_draft_tokens)
    draft_name = backend.recovery.draft_name
    if draft_name and draft_wrap is not None:
        draft_name = f"{draft_name} ({draft_wrap.label})"
    gateway_pb2_grpc.add_GatewayServicer_to_server(
        GatewayServicer(cfg, scheduler, codec, limits, info.model_name, draft_name), server)
    sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(  # for smg, on the same port
        SglangSchedulerServicer(cfg, scheduler, codec, limits,
                                WorkerModel.load(info.model_name, cfg.model, model_dir, codec)), server)
    addr = f"{cfg.host}:{cfg.port}"
    if cfg.tls_cert:
        server.add_secure_port(addr, server_credentials(cfg.tls_cert, cfg.tls_key))
    else:
        if cfg.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("serving plaintext gRPC on %s: set --tls-cert/--tls-key for a non-loopback address", addr)
        server.add_insecure_port(addr)
    await server.start()
    await set_serving(health, ["specsplit.v1.Gateway"], True)
    log.info("gateway on %s:%d (target %s, draft %s; speculation loop on %s)", cfg.host, cfg.port, cfg.target_addr,
             draft_name or "none", "its own thread" if loop_thread is not None else "the server's event loop")

    async def on_stop() -> None:
        await set_serving(health, ["specsplit.v1.Gateway"], False)
        await on_backend(backend.stop())
        if loop_thread is not None:
            loop_thread.stop()

    try:
        await serve_until_signal(server, on_stop)
    finally:
        telemetry.shutdown()


def main(argv: list[str] | None = None, draft_wrap: DraftWrap | None = None) -> None:
    try:
        cfg = parse_args(argv)
    except (ValueError, OSError) as e:  # a bad setting: say which, no traceback
        raise SystemExit(f"gateway: configuration error: {e}") from None
    configure_logging("gateway")
    exit_with_launcher()
    install_uvloop()
    asyncio.run(serve(cfg, draft_wrap))


if __name__ == "__main__":
    main()
