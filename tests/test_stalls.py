"""Faults a production stack meets, on the real services: a stalled target or draft, a gateway
stopped or killed with streams in flight, a target dying while idle, a greedy client, a huge
request. Afterwards nothing is left held in either service, and the stack serves losslessly."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from tests.test_faults import PROMPT, draft_active, health, target_stats

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def stack_cfg(tiny_target: Path, tiny_head: Path, log_dir: Path, **settings: object) -> StackConfig:
    """Quick liveness (0.5 s) and a short lease (3 s), so that faults show within seconds."""
    return StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=4096, log_dir=log_dir,
                          liveness_timeout_s=0.5, lease_s=3.0, draft_retry_s=0.5,
                          **{"max_sequences": 4, "max_new_tokens_cap": 4000, **settings})


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def nothing_held(stack: ServiceStack) -> bool:
    t = target_stats(stack)
    return (t.active_sequences, t.ring_rows_in_use, draft_active(stack)) == (0, 0, 0)


def long_streams(client: GatewayClient, n: int) -> list[grpc.Future]:
    """n streams of 3900 tokens, each past its first message."""
    calls = [client.stub.Generate(make_request(token_ids=[*PROMPT, i], max_new_tokens=3900, ignore_eos=True,
                                               num_steps=2 + i % 3)) for i in range(n)]
    for c in calls:
        next(c)
    return calls


def ended_with(call: grpc.Future) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    return err.value


def same_as_target_only(client: GatewayClient) -> None:
    base = client.generate(make_request(token_ids=PROMPT, max_new_tokens=40, ignore_eos=True, speculation=False))
    spec = client.generate(make_request(token_ids=PROMPT, max_new_tokens=40, ignore_eos=True, num_steps=3))
    assert spec.token_ids == base.token_ids and len(base.token_ids) == 40


def test_a_stalled_target_that_comes_back_holds_nothing(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    with ServiceStack(stack_cfg(tiny_target, tiny_head, tmp_path)) as stack:
        gw = stack.addr("gateway")
        client = GatewayClient(gw)
        calls = long_streams(client, 3)
        stack.signal("target", signal.SIGSTOP)
        stopped = time.monotonic()
        for call in calls:
            err = ended_with(call)
            assert err.code() == grpc.StatusCode.UNAVAILABLE and err.details() == "target service unavailable"
        assert time.monotonic() - stopped < 5.0  # the liveness watch, not the 30 s step timeout
        wait_for(lambda: health(gw) == NOT_SERVING, 5, "health NOT_SERVING")
        time.sleep(1.0)
        stack.signal("target", signal.SIGCONT)
        wait_for(lambda: health(gw) == SERVING, 30, "health SERVING again")
        wait_for(lambda: nothing_held(stack), 10, "nothing held in target and draft")
        wait_for(lambda: client.model_info().draft_available, 30, "the draft attached again")
        same_as_target_only(client)
        wait_for(lambda: nothing_held(stack), 10, "nothing held after new requests")
        client.close()


def test_a_stalled_draft_never_stalls_the_stream(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    with ServiceStack(stack_cfg(tiny_target, tiny_head, tmp_path)) as stack:
        client = GatewayClient(stack.addr("gateway"))
        n = 2500
        base = client.generate(make_request(token_ids=PROMPT, max_new_tokens=n, ignore_eos=True, speculation=False))
        call = client.stub.Generate(make_request(token_ids=PROMPT, max_new_tokens=n, ignore_eos=True, num_steps=3))
        tokens = list(next(call).token_ids)
        stack.signal("draft", signal.SIGSTOP)
        stalled, gaps, last = time.monotonic(), [], time.monotonic()
        resumed = False
        for msg in call:
            now = time.monotonic()
            if now - stalled < 4.0:
                gaps.append(now - last)
            elif not resumed:
                stack.signal("draft", signal.SIGCONT)
                resumed = True
            last = now
            tokens += msg.token_ids
        assert tokens == base.token_ids
        assert max(gaps) < 2.0, f"the stream stood still for {max(gaps):.1f} s while the draft was stalled"
        wait_for(lambda: client.model_info().draft_available, 30, "the draft attached again")
        same_as_target_only(client)
        wait_for(lambda: nothing_held(stack), 10, "nothing held in target and draft")
        client.close()
    assert "speculation suspended" in (tmp_path / "gateway.log").read_text()


def test_a_gateway_stopped_with_streams_in_flight_releases_them(tiny_target: Path, tiny_head: Path,
                                                               tmp_path: Path) -> None:
    with ServiceStack(stack_cfg(tiny_target, tiny_head, tmp_path, shutdown_grace_s=0.5)) as stack:
        client = GatewayClient(stack.addr("gateway"))
        calls = long_streams(client, 3)
        stack.signal("gateway", signal.SIGTERM)
        for call in calls:
            err = ended_with(call)
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in (err.details() or "")
        assert stack.wait("gateway") == 0
        wait_for(lambda: nothing_held(stack), 5, "nothing held once the gateway stopped")
        client.close()
        stack.restart("gateway")
        client = GatewayClient(stack.addr("gateway"))
        same_as_target_only(client)
        client.close()
    log = (tmp_path / "gateway.log").read_text()
    assert "Traceback" not in log and "shutting down" in log


def test_a_killed_gateway_loses_its_hold_when_the_lease_lapses(tiny_target: Path, tiny_head: Path,
                                                              tmp_path: Path) -> None:
    with ServiceStack(stack_cfg(tiny_target, tiny_head, tmp_path)) as stack:
        client = GatewayClient(stack.addr("gateway"))
        long_streams(client, 3)
        assert not nothing_held(stack)
        stack.kill("gateway")
        wait_for(lambda: nothing_held(stack), 10, "the lease (3 s) lapsed and the services released all")
        client.close()
        stack.restart("gateway")
        client = GatewayClient(stack.addr("gateway"))
        same_as_target_only(client)
        client.close()


def test_an_idle_target_death_is_noticed_and_said_plainly(tiny_target: Path, tiny_head: Path,
                                                         tmp_path: Path) -> None:
    with ServiceStack(stack_cfg(tiny_target, tiny_head, tmp_path)) as stack:
        gw = stack.addr("gateway")
        client = GatewayClient(gw)
        same_as_target_only(client)
        stack.kill("target")
        wait_for(lambda: health(gw) == NOT_SERVING, 3, "health NOT_SERVING while idle")
        with grpc.insecure_channel(gw) as ch:
            reply = sgl_grpc.SglangSchedulerStub(ch).HealthCheck(sgl.HealthCheckRequest(), timeout=5)
        assert not reply.healthy
        with pytest.raises(grpc.RpcError) as err:
            client.generate(make_request(token_ids=PROMPT, max_new_tokens=4))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and err.value.details() == "target service unavailable"
        client.close()


def test_per_client_stream_limit(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    with ServiceStack(stack_cfg(tiny_target, tiny_head, tmp_path, max_streams_per_client=2)) as stack:
        greedy, other = GatewayClient(stack.addr("gateway")), GatewayClient(stack.addr("gateway"))
        calls = long_streams(greedy, 2)
        with pytest.raises(grpc.RpcError) as err:
            greedy.generate(make_request(token_ids=PROMPT, max_new_tokens=4))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "this client" in err.value.details()
        out = other.generate(make_request(token_ids=PROMPT, max_new_tokens=4, ignore_eos=True))  # another client
        assert len(out.token_ids) == 4
        for c in calls:
            c.cancel()
        greedy.close()
        other.close()


def test_a_huge_request_is_refused_before_it_is_read(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    with ServiceStack(stack_cfg(tiny_target, tiny_head, tmp_path, max_prompt_chars=10_000)) as stack:
        client = GatewayClient(stack.addr("gateway"))
        with pytest.raises(grpc.RpcError) as err:  # 2M ids (~9 MB on the wire) against a 104 KB request limit
            client.generate(make_request(token_ids=[7] * 2_000_000, max_new_tokens=4))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        out = client.generate(make_request(token_ids=PROMPT, max_new_tokens=4, ignore_eos=True))
        assert len(out.token_ids) == 4
        client.close()


def test_a_busy_client_gives_a_slot_back_and_loses_no_token(tiny_target: Path, tiny_head: Path,
                                                            tmp_path: Path) -> None:
    """Two slots, both taken by one client's streams: another client's request runs at once (one
    of them is suspended and resumed later, its KV prefilled again) and every output equals its
    solo target-only run."""
    with ServiceStack(stack_cfg(tiny_target, tiny_head, tmp_path, max_sequences=2)) as stack:
        busy, other = GatewayClient(stack.addr("gateway")), GatewayClient(stack.addr("gateway"))
        prompts = [[*PROMPT, 1], [*PROMPT, 2]]
        solo = [busy.generate(make_request(token_ids=p, max_new_tokens=600, ignore_eos=True, speculation=False))
                for p in prompts]
        calls = [busy.stub.Generate(make_request(token_ids=p, max_new_tokens=600, ignore_eos=True, num_steps=3))
                 for p in prompts]
        firsts = [list(next(c).token_ids) for c in calls]
        quick = other.generate(make_request(token_ids=PROMPT, max_new_tokens=8, ignore_eos=True, num_steps=3))
        assert len(quick.token_ids) == 8
        outs = [first + [t for msg in c for t in msg.token_ids] for first, c in zip(firsts, calls, strict=True)]
        assert outs == [list(s.token_ids) for s in solo]
        wait_for(lambda: nothing_held(stack), 10, "nothing held afterwards")
        busy.close()
        other.close()
    assert "suspended for another client" in (tmp_path / "gateway.log").read_text()
