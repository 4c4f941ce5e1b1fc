"""python -m gateway: the public API; drives the draft -> verify loop."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc

from gateway.clients import DraftClient, GrpcDraft, GrpcTarget
from gateway.config import GatewayConfig
from gateway.liveness import ServiceWatch, Watches
from gateway.loop_thread import LoopThread
from gateway.observe import GatewayMetrics
from gateway.recovery import Recovery
from gateway.requests import ModelLimits
from gateway.scheduler import Limits, Scheduler
from gateway.security import BearerTokenInterceptor, server_credentials
from gateway.server import GatewayServicer
from gateway.sglang_scheduler import SglangSchedulerServicer, WorkerModel
from specsplit.checkpoints.target_checkpoint import resolve_target_dir
from specsplit.flags import config_parser, from_args
from specsplit.forced import ForcedAcceptance
from specsplit.observability.telemetry import Telemetry, setup_telemetry
from specsplit.tokenizer import TextCodec
from specsplit.transport.serving import (
    MAX_MESSAGE_BYTES,
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


def build_parser() -> argparse.ArgumentParser:
    return config_parser(GatewayConfig, prog="gateway", description=__doc__)


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    return from_args(GatewayConfig, build_parser().parse_args(argv)).validate()


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
                  watches: Watches, draft_wrap: DraftWrap | None = None) -> Backend:
    """Reach both services (taking each over with a new epoch) and start the loop, on the
    event loop that will run it."""
    target = GrpcTarget(cfg.target_addr)
    info = await target.describe(timeout=300.0)
    target.epoch = (await watches.take("target")).epoch
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
    limits = Limits(cfg.max_queue, cfg.max_queued_per_client, cfg.step_timeout_s, cfg.draft_timeout_s,
                    cfg.stream_buffer, cfg.unread_timeout_s, cfg.decode_ahead_ms, info.max_draft_tokens + 1,
                    cfg.prefill_chunk)
    scheduler = Scheduler(target, loop_draft, info.max_sequences, limits, telemetry.spans,
                          GatewayMetrics.create(telemetry.meter), cfg.max_num_steps)
    scheduler.on_target_state.append(on_target_state)
    recovery = Recovery(scheduler, target, draft, info.hidden_store, list(info.aux_layer_ids), cfg.max_num_steps,
                        cfg.draft_retry_s, cfg.step_sockets, cfg.max_topk, watches, cfg.draft_ahead, info.device)
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
    server, health = new_server([BearerTokenInterceptor(cfg.auth_token)] if cfg.auth_token else None,
                                max_request_bytes(cfg))
    loop = asyncio.get_running_loop()

    def on_target_state(up: bool) -> None:  # called on the speculation loop's thread
        loop.call_soon_threadsafe(lambda: loop.create_task(set_serving(health, ["specsplit.v1.Gateway"], up)))

    loop_thread = LoopThread("spec-loop").start() if cfg.loop_thread else None

    async def on_backend(coro: Coroutine[Any, Any, T]) -> T:
        return await (loop_thread.run(coro) if loop_thread is not None else coro)

    lost: list[Callable[[str, str], None]] = []  # the scheduler's, once it exists

    def watch(service: str, addr: str) -> ServiceWatch:
        return ServiceWatch(service, addr, cfg.liveness_timeout_s, cfg.lease_s,
                            lambda why: [f(service, why) for f in lost])

    watches = Watches({"target": watch("target", cfg.target_addr),
                       **({"draft": watch("draft", cfg.draft_addr)} if cfg.draft_addr else {})})
    backend = await on_backend(connect(cfg, telemetry, on_target_state, watches, draft_wrap))
    info, scheduler = backend.info, backend.scheduler
    lost.append(scheduler.service_lost)
    watches.start()
    limits = ModelLimits(info.vocab_size, info.max_context, list(info.eos_token_ids), backend.draft is not None,
                         cfg.max_prompt_tokens, info.max_draft_tokens)
    draft_name = backend.recovery.draft_name
    if draft_name and draft_wrap is not None:
        draft_name = f"{draft_name} ({draft_wrap.label})"
    scheduler.forced = ForcedAcceptance.parse(cfg.forced_acceptance)
    if draft_name and scheduler.forced is not None:
        log.warning("benchmark mode: %s (the output is not the model's)", scheduler.forced.label)
        draft_name = f"{draft_name} ({scheduler.forced.label})"
    gateway_pb2_grpc.add_GatewayServicer_to_server(
        GatewayServicer(cfg, scheduler, codec, limits, cfg.served_name(), draft_name, telemetry.tracer), server)
    sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(  # for smg, on the same port
        SglangSchedulerServicer(cfg, scheduler, codec, limits,
                                WorkerModel.load(cfg.served_name(), cfg.model, model_dir, codec),
                                telemetry.tracer), server)
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
        """Admit nothing more, let streams in flight finish (then end them), release their state
        in both services, and stop."""
        await set_serving(health, ["specsplit.v1.Gateway"], False)
        await on_backend(scheduler.drain("the gateway is shutting down", cfg.shutdown_grace_s))
        await watches.close()
        await on_backend(backend.stop())
        if loop_thread is not None:
            loop_thread.stop()

    try:
        await serve_until_signal(server, on_stop)
    finally:
        telemetry.shutdown()


def max_request_bytes(cfg: GatewayConfig) -> int:
    """The largest request worth parsing: the longest prompt text in UTF-8 (or the longest
    token-id list) plus room for the other fields; a larger one is refused unread."""
    return min(4 * cfg.max_prompt_chars, MAX_MESSAGE_BYTES) + 64 * 1024


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
