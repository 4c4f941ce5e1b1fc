"""Hostile input: fuzz the public API of a running gateway (real model, real processes).
Every request ends in a stream with a final message or a clear gRPC status; nothing
crashes, nothing leaks, and the service keeps serving."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.ops import Verify
from specsplit.transport import columns
from specsplit.v1 import gateway_pb2, target_pb2, target_pb2_grpc

INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> ServiceStack:
    cfg = StackConfig.of(model="smollm2", max_context=256, max_sequences=2, num_steps=2,
                         log_dir=tmp_path_factory.mktemp("fuzz"), extra_gateway_args=["--max-new-tokens-cap", "3"])
    with ServiceStack(cfg) as s:
        yield s


@st.composite
def requests(draw: st.DrawFn) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest()
    kind = draw(st.sampled_from(["prompt", "raw_text", "token_ids", "none", "huge"]))
    if kind in ("prompt", "raw_text"):
        setattr(req, kind, draw(st.text(max_size=400)))
    elif kind == "token_ids":
        req.token_ids.ids.extend(draw(st.lists(INT64, max_size=40)))
    elif kind == "huge":
        req.prompt = "ab " * 400_000
    for name, strategy in (("max_new_tokens", INT32), ("temperature", FLOAT32), ("top_p", FLOAT32),
                           ("top_k", INT32), ("seed", st.integers(0, 2**64 - 1))):
        value = draw(st.none() | strategy)
        if value is not None:
            setattr(req, name, value)
    req.stop_token_ids.extend(draw(st.lists(INT64, max_size=5)))
    req.ignore_eos = draw(st.booleans())
    req.speculation.mode = draw(st.integers(0, 7))  # open enum: unknown values arrive as numbers
    steps = draw(st.none() | INT32)
    if steps is not None:
        req.speculation.num_steps = steps
    return req


def check_outcome(run) -> None:  # noqa: ANN001
    try:
        msgs = list(run())
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, f"{e.code()}: {e.details()}"
        assert e.details() and "Traceback" not in e.details()
        return
    assert msgs and msgs[-1].HasField("final")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(req=requests())
def test_fuzzed_requests_get_a_stream_or_a_clear_status(stack: ServiceStack, req: gateway_pb2.GenerateRequest
                                                        ) -> None:
    client = GatewayClient(stack.addr("gateway"))
    try:
        check_outcome(lambda: client.stream(req, timeout=120))
    finally:
        client.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=300))
def test_garbage_bytes_never_crash_the_gateway(stack: ServiceStack, payload: bytes) -> None:
    with grpc.insecure_channel(stack.addr("gateway")) as ch:
        call = ch.unary_stream("/specsplit.v1.Gateway/Generate", request_serializer=lambda b: b,
                               response_deserializer=gateway_pb2.GenerateResponse.FromString)
        try:
            list(call(payload, timeout=120))
        except grpc.RpcError as e:
            assert e.code() in ALLOWED, f"{e.code()}: {e.details()}"
            assert e.details() and "Traceback" not in e.details()


def test_a_step_whose_columns_do_not_line_up_is_refused_with_a_clear_status(stack: ServiceStack) -> None:
    req = target_pb2.TargetStepRequest(step_id=1)
    columns.write_target_step(req, [Verify(i, [5]) for i in range(1, 9)])
    req.verifies.draft_ids.append(5)  # nine drafts for eight counted
    with grpc.insecure_channel(stack.addr("target")) as ch, pytest.raises(grpc.RpcError) as e:
        list(target_pb2_grpc.TargetServiceStub(ch).Step(iter([req]), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "draft_ids has 9 entries" in e.value.details() and "Traceback" not in e.value.details()


def test_still_serving_and_nothing_leaked_after_fuzzing(stack: ServiceStack) -> None:
    client = GatewayClient(stack.addr("gateway"))
    out = client.generate(make_request("Hello!", max_new_tokens=3))
    assert out.final is not None and len(out.token_ids) >= 1
    client.close()
    with grpc.insecure_channel(stack.addr("target")) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        deadline = time.monotonic() + 10
        while (st_ := stub.Stats(target_pb2.TargetStatsRequest(), timeout=5)).active_sequences and \
                time.monotonic() < deadline:
            time.sleep(0.1)
    assert st_.active_sequences == 0 and st_.ring_rows_in_use == 0
    for log in Path(stack.cfg.log_dir).glob("*.log"):  # type: ignore[arg-type]
        assert "Traceback" not in log.read_text(), log.name
