"""Faults: a draft that dies and comes back, a target that dies, deadlines."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.cli.client import GatewayClient, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def stack_cfg(tiny_target: Path, tiny_head: Path, log_dir: Path) -> StackConfig:
    return StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=4096, max_sequences=4,
                          log_dir=log_dir, extra_gateway_args=["--max-new-tokens-cap", "4000"])


def health(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def draft_active(stack: ServiceStack) -> int:
    with grpc.insecure_channel(stack.addr("draft")) as ch:
        return draft_pb2_grpc.DraftServiceStub(ch).Stats(draft_pb2.DraftStatsRequest(), timeout=5).active_sequences


def target_stats(stack: ServiceStack) -> target_pb2.TargetStats:
    with grpc.insecure_channel(stack.addr("target")) as ch:
        return target_pb2_grpc.TargetServiceStub(ch).Stats(target_pb2.TargetStatsRequest(), timeout=5)


@pytest.mark.parametrize("ahead", ["off", "on"])
def test_draft_dies_mid_stream_then_comes_back(tiny_target: Path, tiny_head: Path, tmp_path: Path, ahead: str) -> None:
    """The draft killed mid-stream (drafting ahead or not): the stream goes on target-only with
    the same tokens, and speculation (drafting ahead too) resumes once the draft is back."""
    cfg = stack_cfg(tiny_target, tiny_head, tmp_path)
    cfg.extra_gateway_args += ["--draft-ahead", ahead]
    with ServiceStack(cfg) as stack:
        client = GatewayClient(stack.addr("gateway"))
        n = 3000  # more than the stream's buffer (1024): it is still running once the draft is back
        base = client.generate(make_request(token_ids=PROMPT, max_new_tokens=n, ignore_eos=True, speculation=False))
        call = client.stub.Generate(make_request(token_ids=PROMPT, max_new_tokens=n, ignore_eos=True, num_steps=3))
        tokens = list(next(call).token_ids)
        stack.kill("draft")
        stack.restart("draft")  # a new process: no state, no mapping
        # until the gateway has the draft back the stream waits unread in its buffer, so that it is still
        # running then, however slowly the draft came back on a loaded machine
        deadline = time.monotonic() + 60
        while not client.model_info().draft_available and time.monotonic() < deadline:
            time.sleep(0.1)
        resumed = False
        for msg in call:  # the stream never stops; the draft is re-attached and the sequence resynced
            tokens += msg.token_ids
            if not resumed and not msg.HasField("final"):
                resumed = draft_active(stack) == 1
            if msg.HasField("final"):
                final = msg.final
        assert tokens == base.token_ids and final.finish_reason == "length"
        assert resumed, "speculation did not resume for the running stream"
        assert client.model_info().draft_available
        after = client.generate(make_request(token_ids=PROMPT, max_new_tokens=20, ignore_eos=True, num_steps=3))
        assert after.token_ids == base.token_ids[:20] and after.final.speculation.draft_ms > 0
        drafted_ahead = after.final.speculation.draft_ahead_hits + after.final.speculation.draft_ahead_misses
        assert (drafted_ahead > 0) == (ahead == "on")
        client.close()
    assert "speculation suspended" in (tmp_path / "gateway.log").read_text()


def test_target_dies_streams_end_unavailable_and_health_flips(tiny_target: Path, tiny_head: Path,
                                                               tmp_path: Path) -> None:
    with ServiceStack(stack_cfg(tiny_target, tiny_head, tmp_path)) as stack:
        gw = stack.addr("gateway")
        assert health(gw) == health_pb2.HealthCheckResponse.SERVING
        client = GatewayClient(gw)
        calls = [client.stub.Generate(make_request(token_ids=PROMPT, max_new_tokens=3900, ignore_eos=True,
                                                   num_steps=2 + i)) for i in range(2)]
        for c in calls:
            next(c)
        killed = time.monotonic()
        stack.kill("target")
        for c in calls:
            with pytest.raises(grpc.RpcError) as err:
                for _ in c:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - killed < 2.0
        deadline = time.monotonic() + 2.0
        while health(gw) != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health(gw) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            client.generate(make_request(token_ids=PROMPT, max_new_tokens=4))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        stack.restart("target")  # recovery: reconnect, re-attach the draft to the new ring
        deadline = time.monotonic() + 30
        while health(gw) != health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
            time.sleep(0.2)
        out = client.generate(make_request(token_ids=PROMPT, max_new_tokens=16, ignore_eos=True, num_steps=3))
        assert len(out.token_ids) == 16
        deadline = time.monotonic() + 30
        while not client.model_info().draft_available and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.model_info().draft_available
        client.close()


def test_deadline_releases_the_sequence_in_both_services(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    with ServiceStack(stack_cfg(tiny_target, tiny_head, tmp_path)) as stack:
        client = GatewayClient(stack.addr("gateway"))
        with pytest.raises(grpc.RpcError) as err:
            client.generate(make_request(token_ids=PROMPT, max_new_tokens=3900, ignore_eos=True, num_steps=3),
                            timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            t = target_stats(stack)
            if t.active_sequences == 0 and draft_active(stack) == 0 and t.ring_rows_in_use == 0:
                break
            time.sleep(0.1)
        t = target_stats(stack)
        assert (t.active_sequences, t.ring_rows_in_use, draft_active(stack)) == (0, 0, 0)
        client.close()
