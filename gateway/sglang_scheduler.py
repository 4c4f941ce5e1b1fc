"""gRPC edge for SGLang's scheduler protocol (sglang.grpc.scheduler.SglangScheduler, the
generated modules of smg-grpc-proto), so smg, the SGLang model gateway, can route to
specsplit as to an SGLang worker. A thin servicer over the same Scheduler as the public
API: requests arrive tokenized, tokens go back as ids (smg detokenizes)."""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import logging
import time
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from hashlib import sha256
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import grpc
from google.protobuf import struct_pb2, timestamp_pb2
from opentelemetry import trace
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway.config import GatewayConfig
from gateway.observe import NOOP_TRACER
from gateway.scheduler import Finished, Scheduler, Sequence
from gateway.sglang_requests import MAX_REQUEST_ID_CHARS, parse_sglang
from gateway.stream import Admission
from gateway.validation import ModelLimits
from specsplit.tokenizer import TextCodec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                   "special_tokens_map.json")
TOKENIZER_CHUNK_BYTES = 64 * 1024
LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}


def _own_version() -> str:
    try:
        return version("specsplit")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "source"


SERVER_VERSION = f"specsplit-{_own_version()}"  # where SGLang reports its version
log = logging.getLogger("specsplit.gateway")


def _unsupported(name: str):  # noqa: ANN202 - a servicer method
    async def method(self, request: object, context: grpc.aio.ServicerContext) -> None:  # noqa: ANN001
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not supported by this worker")

    return method


@dataclass
class WorkerModel:
    """What GetModelInfo reports: the target's facts and the tokenizer directory."""

    name: str
    spec: str  # the --model spec the services were started with
    tokenizer_dir: Path | None  # holds tokenizer.json (and tokenizer_config.json with the chat template)
    config: dict = field(default_factory=dict)  # the model's config.json, when there is one

    @classmethod
    def load(cls, name: str, spec: str, model_dir: Path, codec: TextCodec | None) -> WorkerModel:
        cfg_path = model_dir / "config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        return cls(name, spec, model_dir if codec is not None else None, config)


def tokenizer_zip(directory: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            if (directory / name).is_file():
                zf.write(directory / name, name)
    return buf.getvalue()


class SglangSchedulerServicer(sgl_grpc.SglangSchedulerServicer):
    def __init__(self, cfg: GatewayConfig, scheduler: Scheduler, codec: TextCodec | None, limits: ModelLimits,
                 model: WorkerModel, tracer: trace.Tracer | None = None) -> None:
        self.cfg, self.scheduler, self.codec, self.limits, self.model = cfg, scheduler, codec, limits, model
        self.admission = Admission(scheduler, tracer or NOOP_TRACER, cfg.max_streams, cfg.max_streams_per_client)
        self.active: dict[str, Sequence] = {}  # request_id -> its sequence, for Abort
        self.started = time.time()
        self.last_loads = (time.monotonic(), 0)  # (when, output tokens) at the previous GetLoads
        self.tokenizer_bundle: tuple[bytes, str] | None = None

    # UNIMPLEMENTED without a traceback in the log (smg tries SubscribeKvEvents at registration, then stops)
    Embed = _unsupported("Embed")
    FlushCache = _unsupported("FlushCache")
    StartProfile = _unsupported("StartProfile")
    StopProfile = _unsupported("StopProfile")
    LoadLoRAAdapter = _unsupported("LoadLoRAAdapter")
    UnloadLoRAAdapter = _unsupported("UnloadLoRAAdapter")
    ListLoadedLoRAAdapters = _unsupported("ListLoadedLoRAAdapters")

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
                                ) -> AsyncIterator[common_pb2.KvEventBatch]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker publishes no KV cache events")
        yield common_pb2.KvEventBatch()  # pragma: no cover - abort raises; makes this a stream handler

    # -- generation
    async def Generate(self, request: sgl.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[sgl.GenerateResponse]:
        rid = request.request_id
        attributes = {"gen_ai.request.model": self.model.name, "specsplit.api": "sglang",
                      "specsplit.request_id": rid[:MAX_REQUEST_ID_CHARS]}
        async with self.admission.call(context, attributes) as call:
            req = await call.parse(lambda: parse_sglang(request, self.codec, self.cfg, self.limits))
            if rid in self.active:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already running")
            seq = await call.submit(req)
            self.active[rid] = seq
            try:
                # counted here: seq.generated belongs to the speculation loop, which may be a cycle ahead
                prompt_tokens, completion_tokens = len(req.prompt_ids), 0
                async for tokens in call.tokens(1):  # each cycle's tokens in a chunk of their own
                    completion_tokens += len(tokens)
                    if request.stream:
                        yield sgl.GenerateResponse(request_id=rid, chunk=sgl.GenerateStreamChunk(
                            token_ids=tokens, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens))
                yield sgl.GenerateResponse(request_id=rid, complete=self._complete(seq, call.finished))
            finally:
                if self.active.get(rid) is seq:
                    del self.active[rid]
                if not seq.done:
                    log.info("sglang request %s: call ended by the client, releasing it", rid)

    @staticmethod
    def _complete(seq: Sequence, end: Finished) -> sgl.GenerateComplete:
        done = sgl.GenerateComplete(
            output_ids=seq.generated, finish_reason=end.reason, prompt_tokens=len(seq.req.prompt_ids),
            completion_tokens=len(seq.generated), spec_accepted_tokens=seq.stats.accepted_drafts,
            spec_draft_tokens=seq.stats.draft_tokens)
        if end.matched_stop is not None:
            done.matched_token_id = end.matched_stop
        return done

    async def Abort(self, request: sgl.AbortRequest, context: grpc.aio.ServicerContext) -> sgl.AbortResponse:
        rid = request.request_id[:MAX_REQUEST_ID_CHARS]
        seq = self.active.get(rid)
        log.info("sglang Abort %s (%s)", rid, "running" if seq is not None else "not found")
        if seq is None:
            return sgl.AbortResponse(success=False, message=f"request {rid!r} not found")
        self.scheduler.cancel(seq)
        return sgl.AbortResponse(success=True, message=f"request {rid!r} aborted")

    # -- state
    async def HealthCheck(self, request: sgl.HealthCheckRequest, context: grpc.aio.ServicerContext
                          ) -> sgl.HealthCheckResponse:
        """Healthy while the target answers (a lost draft only turns speculation off)."""
        if self.scheduler.target_down:
            return sgl.HealthCheckResponse(healthy=False, message="target service unavailable")
        mode = "speculative" if self.scheduler.speculating else "target-only (no draft attached)"
        return sgl.HealthCheckResponse(healthy=True, message=f"serving, {mode}")

    async def GetModelInfo(self, request: sgl.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> sgl.GetModelInfoResponse:
        c = self.model.config
        bos = c.get("bos_token_id")
        if bos is None and self.codec is not None and self.codec.bos_token:
            bos = self.codec.tokenizer.token_to_id(self.codec.bos_token)
        return sgl.GetModelInfoResponse(
            model_path=self.model.spec, tokenizer_path=str(self.model.tokenizer_dir or ""), is_generation=True,
            served_model_name=self.model.name, max_context_length=self.limits.max_context,
            vocab_size=self.limits.vocab_size, supports_vision=False, model_type=str(c.get("model_type", "")),
            architectures=[str(a) for a in c.get("architectures", [])], eos_token_ids=self.limits.eos_token_ids,
            pad_token_id=int(c.get("pad_token_id") or 0), bos_token_id=int(bos or 0),
            max_req_input_len=self.limits.max_context - self.cfg.max_num_steps - 2)

    async def GetServerInfo(self, request: sgl.GetServerInfoRequest, context: grpc.aio.ServicerContext
                            ) -> sgl.GetServerInfoResponse:
        s = self.scheduler
        args = struct_pb2.Struct()
        args.update({"model_path": self.model.spec, "served_model_name": self.model.name,
                     "tokenizer_path": str(self.model.tokenizer_dir or ""), "dp_size": 1,
                     "context_length": self.limits.max_context, "max_running_requests": s.max_sequences,
                     "max_total_tokens": s.max_sequences * self.limits.max_context, "is_embedding": False,
                     "vocab_size": self.limits.vocab_size, "speculative_algorithm": "EAGLE3",
                     "speculative_num_steps": self.cfg.default_num_steps,
                     "speculative_eagle_topk": self.cfg.default_topk,  # SGLang's names; a chain is topk 1
                     "speculative_num_draft_tokens": (self.cfg.default_num_draft_tokens if self.cfg.default_topk > 1
                                                      else self.cfg.default_num_steps + 1),
                     "target_addr": self.cfg.target_addr,
                     "draft_addr": self.cfg.draft_addr})
        info = struct_pb2.Struct()
        info.update({"max_sequences": s.max_sequences, "max_queue": s.limits.max_queue, "speculating": s.speculating})
        start = timestamp_pb2.Timestamp()
        start.FromSeconds(int(self.started))
        return sgl.GetServerInfoResponse(
            server_args=args, scheduler_info=info, active_requests=len(s.running) + len(s.waiting),
            is_paused=False, uptime_seconds=time.time() - self.started,
            sglang_version=SERVER_VERSION, server_type="grpc", start_time=start,
            max_total_num_tokens=s.max_sequences * self.limits.max_context)

    async def GetLoads(self, request: sgl.GetLoadsRequest, context: grpc.aio.ServicerContext
                       ) -> sgl.GetLoadsResponse:
        include = set(request.include) or {"all"}
        if unknown := include - LOAD_SECTIONS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"unknown load sections {sorted(unknown)}; known: {sorted(LOAD_SECTIONS)}")
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"dp_rank {request.dp_rank}: this worker has rank 0")
        s, t = self.scheduler, self.scheduler.totals
        capacity = s.max_sequences * self.limits.max_context
        used = sum(q.committed for q in s.running)
        now = time.monotonic()
        then, tokens_then = self.last_loads
        self.last_loads = (now, t.output_tokens)
        load = sgl.SchedulerLoad(
            dp_rank=0, num_running_reqs=len(s.running), num_waiting_reqs=len(s.waiting),
            num_total_reqs=len(s.running) + len(s.waiting), num_used_tokens=used, max_total_num_tokens=capacity,
            token_usage=used / capacity, gen_throughput=(t.output_tokens - tokens_then) / max(now - then, 1e-9),
            utilization=len(s.running) / s.max_sequences, max_running_requests=s.max_sequences)
        if include & {"spec", "all"}:
            load.speculative.CopyFrom(sgl.SpeculativeMetrics(
                accept_length=t.verify_tokens / t.verify_cycles if t.verify_cycles else 0.0,
                accept_rate=t.accepted_drafts / t.draft_tokens if t.draft_tokens else 0.0))
        if include & {"queues", "all"}:
            load.queues.CopyFrom(sgl.QueueMetrics(waiting=len(s.waiting)))
        return sgl.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.UTC).isoformat(), version=SERVER_VERSION,
            dp_rank_count=1, loads=[load], aggregate=sgl.AggregateMetrics(
                total_running_reqs=load.num_running_reqs, total_waiting_reqs=load.num_waiting_reqs,
                total_reqs=load.num_total_reqs, avg_token_usage=load.token_usage,
                avg_throughput=load.gen_throughput, avg_utilization=load.utilization))

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """The tokenizer files as one zip, in 64 KiB chunks; the last one carries its SHA-256."""
        if self.model.tokenizer_dir is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer")
        if self.tokenizer_bundle is None:
            data = await asyncio.to_thread(tokenizer_zip, self.model.tokenizer_dir)
            self.tokenizer_bundle = (data, sha256(data).hexdigest())
        data, digest = self.tokenizer_bundle
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = min(start + TOKENIZER_CHUNK_BYTES, len(data))
            yield common_pb2.GetTokenizerChunk(data=data[start:end], sha256=digest if end == len(data) else "")
