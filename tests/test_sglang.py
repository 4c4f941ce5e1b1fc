"""The gateway's SGLang scheduler API (sglang.grpc.scheduler.SglangScheduler), called
directly and through the real smg router (OpenAI HTTP), on the three real services."""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from test_services import service_stats, wait_idle

from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.ports import free_port
from specsplit.tokenizer import TextCodec

PROMPT = "What is the capital of France?"
LONG_PROMPT = "Tell me a long story about a dragon."
DEFAULT_MAX_NEW_TOKENS = 12  # the gateway's --max-new-tokens here


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceStack]:
    cfg = StackConfig.of(model="smollm2", head="random", max_context=512, max_sequences=4, num_steps=3,
                         log_dir=tmp_path_factory.mktemp("logs"),
                         # a random head accepts nothing: with steps chosen per cycle, no cycle would draft
                         extra_gateway_args=["--max-new-tokens", str(DEFAULT_MAX_NEW_TOKENS), "--no-adaptive-steps"])
    with ServiceStack(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def sglang(stack: ServiceStack) -> Iterator[sgl_grpc.SglangSchedulerStub]:
    with grpc.insecure_channel(stack.addr("gateway")) as channel:
        yield sgl_grpc.SglangSchedulerStub(channel)


@pytest.fixture(scope="module")
def codec(smollm2_dir: Path) -> TextCodec:
    c = TextCodec.from_checkpoint(smollm2_dir)
    assert c is not None
    return c


def chat_ids(codec: TextCodec, text: str) -> list[int]:
    return codec.encode(codec.render_chat(text))


def generate_request(rid: str, ids: list[int], stream: bool = False, max_new_tokens: int | None = None,
                     **sampling: object) -> sgl.GenerateRequest:
    defaults = dict(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1, skip_special_tokens=True)
    params = sgl.SamplingParams(**{**defaults, **sampling})  # what smg sends, plus the test's own
    if max_new_tokens is not None:
        params.max_new_tokens = max_new_tokens
    return sgl.GenerateRequest(request_id=rid, tokenized=sgl.TokenizedInput(input_ids=ids), sampling_params=params,
                               stream=stream)


def run(stub: sgl_grpc.SglangSchedulerStub, req: sgl.GenerateRequest) -> tuple[list[int], sgl.GenerateComplete]:
    """Streamed token ids (empty when not streaming) and the final Complete."""
    streamed: list[int] = []
    complete = None
    for msg in stub.Generate(req, timeout=120):
        assert msg.request_id == req.request_id
        if msg.HasField("chunk"):
            streamed += msg.chunk.token_ids
        else:
            complete = msg.complete
    assert complete is not None
    return streamed, complete


# -- the SGLang API called directly

def test_model_server_info_and_health(sglang: sgl_grpc.SglangSchedulerStub, smollm2_dir: Path) -> None:
    info = sglang.GetModelInfo(sgl.GetModelInfoRequest(), timeout=10)
    assert Path(info.tokenizer_path) == smollm2_dir and (Path(info.tokenizer_path) / "tokenizer.json").exists()
    assert info.is_generation and info.served_model_name == "SmolLM2-135M-Instruct" and info.max_context_length == 512
    assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2]
    server = sglang.GetServerInfo(sgl.GetServerInfoRequest(), timeout=10)
    assert server.server_type == "grpc" and server.server_args["dp_size"] == 1
    assert server.server_args["max_running_requests"] == 4
    args = server.server_args
    assert (args["speculative_eagle_topk"], args["speculative_num_draft_tokens"]) == (1,
                                                                                    args["speculative_num_steps"] + 1)
    health = sglang.HealthCheck(sgl.HealthCheckRequest(), timeout=10)
    assert health.healthy, health.message
    with pytest.raises(grpc.RpcError) as err:
        sglang.FlushCache(common_pb2.FlushCacheRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_get_tokenizer_streams_a_checked_zip(sglang: sgl_grpc.SglangSchedulerStub, smollm2_dir: Path) -> None:
    chunks = list(sglang.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    assert chunks and all(not c.sha256 for c in chunks[:-1])
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert {"tokenizer.json", "tokenizer_config.json"} <= set(zf.namelist())
        assert zf.read("tokenizer.json") == (smollm2_dir / "tokenizer.json").read_bytes()


def test_generate_equals_the_public_api_streaming_or_not(sglang: sgl_grpc.SglangSchedulerStub, stack: ServiceStack,
                                                         codec: TextCodec) -> None:
    client = GatewayClient(stack.addr("gateway"))
    public = client.generate(make_request(PROMPT, max_new_tokens=16))
    client.close()
    ids = chat_ids(codec, PROMPT)
    streamed, complete = run(sglang, generate_request("direct-1", ids, stream=True, max_new_tokens=16))
    assert streamed == list(complete.output_ids) == public.token_ids
    _, whole = run(sglang, generate_request("direct-2", ids, max_new_tokens=16))
    assert list(whole.output_ids) == public.token_ids
    assert whole.finish_reason == public.final.finish_reason == "stop" and whole.matched_token_id == 2  # EOS
    assert whole.prompt_tokens == len(ids) and whole.completion_tokens == len(public.token_ids)
    assert whole.spec_draft_tokens > 0 and 0 <= whole.spec_accepted_tokens <= whole.spec_draft_tokens


def test_stops_at_stop_ids_max_new_tokens_and_the_default(sglang: sgl_grpc.SglangSchedulerStub,
                                                          codec: TextCodec) -> None:
    ids = chat_ids(codec, LONG_PROMPT)
    _, unset = run(sglang, generate_request("stops-1", ids, ignore_eos=True))
    assert unset.finish_reason == "length" and len(unset.output_ids) == DEFAULT_MAX_NEW_TOKENS
    _, short = run(sglang, generate_request("stops-2", ids, max_new_tokens=5, ignore_eos=True))
    assert short.finish_reason == "length" and list(short.output_ids) == list(unset.output_ids)[:5]
    stop = unset.output_ids[6]
    _, stopped = run(sglang, generate_request("stops-3", ids, stop_token_ids=[stop], ignore_eos=True))
    cut = list(unset.output_ids).index(stop)
    assert stopped.finish_reason == "stop" and stopped.matched_token_id == stop
    assert list(stopped.output_ids) == list(unset.output_ids)[:cut]
    word = codec.decode([stop])  # a one-token stop string is a stop id too
    if codec.encode(word) == [stop]:
        _, by_string = run(sglang, generate_request("stops-4", ids, stop=[word], ignore_eos=True))
        assert list(by_string.output_ids) == list(stopped.output_ids) and by_string.matched_token_id == stop


def test_abort_ends_the_stream_and_releases_it(sglang: sgl_grpc.SglangSchedulerStub, stack: ServiceStack,
                                               codec: TextCodec) -> None:
    req = generate_request("abort-me", chat_ids(codec, LONG_PROMPT), stream=True, max_new_tokens=400,
                           ignore_eos=True)
    call = sglang.Generate(req, timeout=120)
    assert next(call).chunk.token_ids
    with pytest.raises(grpc.RpcError) as dup:
        run(sglang, req)
    assert dup.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert sglang.Abort(sgl.AbortRequest(request_id="abort-me"), timeout=10).success
    last = list(call)[-1]
    assert last.complete.finish_reason == "abort" and len(last.complete.output_ids) < 400
    t, d = wait_idle(stack)
    assert (t.active_sequences, d.active_sequences, t.ring_rows_in_use) == (0, 0, 0)
    assert not sglang.Abort(sgl.AbortRequest(request_id="abort-me"), timeout=10).success


def test_a_cancelled_call_is_released(sglang: sgl_grpc.SglangSchedulerStub, stack: ServiceStack,
                                      codec: TextCodec) -> None:
    call = sglang.Generate(generate_request("cancel-me", chat_ids(codec, LONG_PROMPT), max_new_tokens=400,
                                            ignore_eos=True), timeout=120)
    wait_active(stack)
    call.cancel()
    t, d = wait_idle(stack)
    assert (t.active_sequences, d.active_sequences, t.ring_rows_in_use) == (0, 0, 0)


BAD = {
    "no request id": dict(rid=""),
    "no input ids": dict(ids=[]),
    "unknown token id": dict(ids=[1, 49152]),
    "prompt longer than context": dict(ids=[42] * 600),
    "max_new_tokens over the context": dict(max_new_tokens=510),
    "logprobs": dict(request=dict(return_logprob=True)),
    "n > 1": dict(sampling=dict(n=2)),
    "json schema": dict(sampling=dict(json_schema="{}")),
    "min_p": dict(sampling=dict(min_p=0.1)),
    "negative temperature": dict(sampling=dict(temperature=-1.0)),
    "multi-token stop string": dict(sampling=dict(stop=["the capital of"])),
    "too many stop ids": dict(sampling=dict(stop_token_ids=list(range(65)))),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_requests_are_invalid_argument(sglang: sgl_grpc.SglangSchedulerStub, name: str) -> None:
    case = BAD[name]
    req = generate_request(case.get("rid", "bad"), case.get("ids", [1, 2, 3]),
                           max_new_tokens=case.get("max_new_tokens"), **case.get("sampling", {}))
    for field, value in case.get("request", {}).items():
        setattr(req, field, value)
    with pytest.raises(grpc.RpcError) as err:
        run(sglang, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details() and "Traceback" not in err.value.details()


def test_loads_report_speculation(sglang: sgl_grpc.SglangSchedulerStub) -> None:
    loads = sglang.GetLoads(sgl.GetLoadsRequest(), timeout=10)  # after the generations above
    assert loads.dp_rank_count == 1 and len(loads.loads) == 1
    load = loads.loads[0]
    assert load.max_running_requests == 4 and load.num_running_reqs == 0 and load.num_waiting_reqs == 0
    assert load.HasField("speculative") and load.speculative.accept_length >= 1.0
    assert 0.0 <= load.speculative.accept_rate <= 1.0
    core = sglang.GetLoads(sgl.GetLoadsRequest(include=["core"]), timeout=10).loads[0]
    assert not core.HasField("speculative")
    with pytest.raises(grpc.RpcError) as err:
        sglang.GetLoads(sgl.GetLoadsRequest(include=["everything"]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- through the real smg router: OpenAI HTTP in front of the gateway

@pytest.fixture(scope="module")
def smg(stack: ServiceStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, str]]:
    """`smg launch` on loopback with the gateway as its one worker; yields (port, model id)."""
    port = free_port()
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", f"grpc://{stack.addr('gateway')}", "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(free_port())],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield port, wait_router_ready(port, proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_router_ready(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120.0) -> str:
    """The model id, once the worker is registered and a one-token chat completes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited with code {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            status, raw = http_call(port, "GET", "/v1/models")
            models = json.loads(raw).get("data") if status == 200 else None  # an error body until it is up
            if models:
                body = {"model": models[0]["id"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
                if http_call(port, "POST", "/v1/chat/completions", body)[0] == 200:
                    return models[0]["id"]
        except (OSError, ValueError):  # not listening yet, or not JSON yet
            pass
        time.sleep(0.25)
    raise TimeoutError(f"smg not ready after {timeout:.0f} s")


def http_call(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def chat_stream(port: int, body: dict) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        text = ""
        for line in resp:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
        return text
    finally:
        conn.close()


def open_chat(port: int, body: dict) -> socket.socket:
    """A chat request on a raw socket, so that the test can drop the connection."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def wait_active(stack: ServiceStack, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while service_stats(stack)[0].active_sequences == 0:
        assert time.monotonic() < deadline, "no sequence became active"
        time.sleep(0.05)


def gateway_log(stack: ServiceStack) -> str:
    assert stack.cfg.log_dir is not None
    return (stack.cfg.log_dir / "gateway.log").read_text()


def wait_log_count(stack: ServiceStack, text: str, more_than: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while gateway_log(stack).count(text) <= more_than:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("stream", [False, True])
def test_smg_chat_returns_the_gateway_text(smg: tuple[int, str], stack: ServiceStack, codec: TextCodec,
                                           stream: bool) -> None:
    port, model = smg
    assert model == "SmolLM2-135M-Instruct"  # the served name, not the GGUF's internal one
    client = GatewayClient(stack.addr("gateway"))
    direct = client.generate(make_request(PROMPT, max_new_tokens=24))
    client.close()
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 24}
    if stream:
        assert chat_stream(port, body) == direct.text
    else:
        status, raw = http_call(port, "POST", "/v1/chat/completions", body)
        assert status == 200, raw
        out = json.loads(raw)
        assert out["choices"][0]["message"]["content"] == direct.text and direct.text.strip()
        assert out["choices"][0]["finish_reason"] == direct.final.finish_reason
        assert out["usage"]["prompt_tokens"] == len(chat_ids(codec, PROMPT))  # smg's chat template is ours
        assert out["usage"]["completion_tokens"] == len(direct.token_ids)


@pytest.mark.parametrize("stream", [True, False])
def test_smg_client_disconnect_aborts_the_request(smg: tuple[int, str], stack: ServiceStack, stream: bool) -> None:
    """A dropped stream: smg sends Abort. A dropped non-streaming request: smg cancels the call."""
    port, model = smg
    body = {"model": model, "messages": [{"role": "user", "content": LONG_PROMPT}], "temperature": 0,
            "max_tokens": 400, "ignore_eos": True, "stream": stream}
    evidence = "call ended by the client"
    seen = gateway_log(stack).count(evidence)
    sock = open_chat(port, body)
    if stream:  # the response headers come at once and name the request
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        request_id = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                          if line.lower().startswith(b"x-request-id:"))
        evidence, seen = f"sglang Abort {request_id}-", 0
    wait_active(stack)
    sock.close()
    t, d = wait_idle(stack, timeout=20)
    assert (t.active_sequences, d.active_sequences, t.ring_rows_in_use) == (0, 0, 0)
    assert wait_log_count(stack, evidence, seen), f"no {evidence!r} in the gateway log"


def test_compose_health_checks_pass_on_the_running_services(stack: ServiceStack, smg: tuple[int, str]) -> None:
    """The cpu profile's health-check commands, pointed at this stack's ports instead of the containers'."""
    services = yaml.safe_load((Path(__file__).resolve().parent.parent / "docker-compose.yml").read_text())["services"]
    for role in ("target", "draft", "gateway", "smg"):
        _, program, *args = services[f"{role}-cpu"]["healthcheck"]["test"]
        if program == "specsplit":  # the console script, run with this venv's python
            args = ["-m", "specsplit.cli", *[stack.addr(role) if a.startswith("127.0.0.1:") else a for a in args]]
        else:
            assert program == "python"
            args = [a.replace("127.0.0.1:30000", f"127.0.0.1:{smg[0]}") for a in args]
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (role, proc.stdout, proc.stderr)


def test_gateway_log_has_no_tracebacks(stack: ServiceStack) -> None:
    assert "Traceback" not in gateway_log(stack)
