"""Many concurrent streams: per-cycle batching keeps every stream's tokens exact, the
admission queue is bounded, and nothing leaks."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import grpc
import pytest

from specsplit.cli.client import GatewayClient, Generation, make_request
from specsplit.cli.launcher import ServiceStack, StackConfig
from specsplit.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

PROMPTS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello in French.",
           "Write a haiku about rain.", "Define entropy briefly.", "List two prime numbers.", "Who wrote Hamlet?"]


def run_all(addr: str, requests: list) -> list[Generation | grpc.RpcError]:  # noqa: ANN001
    out: list[Generation | grpc.RpcError | None] = [None] * len(requests)

    def one(i: int) -> None:
        client = GatewayClient(addr)
        try:
            out[i] = client.generate(requests[i], timeout=600)
        except grpc.RpcError as e:
            out[i] = e
        finally:
            client.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out  # type: ignore[return-value]


@pytest.mark.slow
def test_32_concurrent_streams_equal_solo_runs(tmp_path: Path) -> None:
    cfg = StackConfig.of(model="smollm2", max_context=512, max_sequences=32, num_steps=3, log_dir=tmp_path)
    with ServiceStack(cfg) as stack:
        addr = stack.addr("gateway")
        client = GatewayClient(addr)
        solo = [client.generate(make_request(p, max_new_tokens=12, speculation=False)).token_ids for p in PROMPTS]
        client.close()
        reqs = [make_request(PROMPTS[i % 8], max_new_tokens=12, num_steps=(i // 8) * 2) for i in range(32)]
        results = run_all(addr, reqs)
        for i, r in enumerate(results):
            assert isinstance(r, Generation), f"stream {i}: {r}"
            assert r.token_ids == solo[i % 8], f"stream {i} differs from its solo run"
        with grpc.insecure_channel(stack.addr("target")) as t, grpc.insecure_channel(stack.addr("draft")) as d:
            deadline = time.monotonic() + 10
            while True:
                ts = target_pb2_grpc.TargetServiceStub(t).Stats(target_pb2.TargetStatsRequest(), timeout=5)
                ds = draft_pb2_grpc.DraftServiceStub(d).Stats(draft_pb2.DraftStatsRequest(), timeout=5)
                if (ts.active_sequences, ts.ring_rows_in_use, ds.active_sequences) == (0, 0, 0) or \
                        time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        assert (ts.active_sequences, ts.ring_rows_in_use, ts.ring_live_allocations, ds.active_sequences) == \
            (0, 0, 0, 0)
        assert ts.free_kv_slots == 32 and ds.free_kv_slots == 32


def test_64_streams_that_start_and_stop_at_random_leave_nothing_behind(tiny_target: Path, tiny_head: Path,
                                                                        tmp_path: Path) -> None:
    """64 streams on 8 slots, each started after a random pause, of a random kind (target-only,
    adaptive, fixed chains, trees, sampled) and length; a third are cancelled after a random
    number of chunks. The streams that ran to the end got what they asked for, and afterwards
    both services hold no sequence, no ring row and no lease on a slot."""
    rng = random.Random(27)
    kinds = [{"speculation": False}, {}, {"num_steps": 2}, {"num_steps": 3, "topk": 3, "num_draft_tokens": 8},
             {"temperature": 0.8, "seed": 5}]
    plans = [(rng.uniform(0, 1.5), rng.choice(kinds), rng.randint(4, 40), rng.randint(1, 6) if rng.random() < 0.34
              else 0) for _ in range(64)]
    cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=256, max_sequences=8,
                         num_steps=3, log_dir=tmp_path)
    with ServiceStack(cfg) as stack:
        addr = stack.addr("gateway")
        done: dict[int, int | str] = {}

        def one(i: int) -> None:
            pause, kind, tokens, cancel_after = plans[i]
            time.sleep(pause)
            client = GatewayClient(addr)
            try:
                call = client.stub.Generate(make_request(token_ids=[1 + i % 50, 7, 3 + i % 11], max_new_tokens=tokens,
                                                         ignore_eos=True, **kind), timeout=300)
                got = 0
                for n, msg in enumerate(call, 1):
                    got += len(msg.token_ids)
                    if cancel_after and n >= cancel_after:
                        call.cancel()
                        break
                done[i] = got
            except grpc.RpcError as e:
                done[i] = "cancelled" if e.code() == grpc.StatusCode.CANCELLED else f"{e.code()}: {e.details()}"
            finally:
                client.close()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert len(done) == 64
        for i, (_, _, tokens, cancel_after) in enumerate(plans):
            if not cancel_after:
                assert done[i] == tokens, f"stream {i}: {done[i]}"
            else:
                assert done[i] == "cancelled" or isinstance(done[i], int), f"stream {i}: {done[i]}"
        with grpc.insecure_channel(stack.addr("target")) as t, grpc.insecure_channel(stack.addr("draft")) as d:
            deadline = time.monotonic() + 20
            while True:
                ts = target_pb2_grpc.TargetServiceStub(t).Stats(target_pb2.TargetStatsRequest(), timeout=5)
                ds = draft_pb2_grpc.DraftServiceStub(d).Stats(draft_pb2.DraftStatsRequest(), timeout=5)
                idle = (ts.active_sequences, ts.ring_rows_in_use, ts.ring_live_allocations, ds.active_sequences)
                if idle == (0, 0, 0, 0) and ts.free_kv_slots == ds.free_kv_slots == 8 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        assert idle == (0, 0, 0, 0) and ts.free_kv_slots == 8 and ds.free_kv_slots == 8


def test_admission_queue_is_bounded(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=4096, max_sequences=1,
                         log_dir=tmp_path, extra_gateway_args=["--max-queue", "1", "--max-new-tokens-cap", "4000"])
    with ServiceStack(cfg) as stack:
        long = make_request(token_ids=[1, 2, 3], max_new_tokens=400, ignore_eos=True, speculation=False)
        results = run_all(stack.addr("gateway"), [long] * 4)  # 1 running + 1 queued; the rest refused
        refused = [r for r in results if isinstance(r, grpc.RpcError)]
        served = [r for r in results if isinstance(r, Generation)]
        assert len(served) == 2 and len(refused) == 2
        assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in r.details() for r in refused)
        assert served[0].token_ids == served[1].token_ids


def test_concurrent_stream_limit(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    cfg = StackConfig.of(model=str(tiny_target), head=str(tiny_head), max_context=4096, log_dir=tmp_path,
                         extra_gateway_args=["--max-streams", "2", "--max-new-tokens-cap", "4000"])
    with ServiceStack(cfg) as stack:
        long = make_request(token_ids=[1, 2, 3], max_new_tokens=400, ignore_eos=True, speculation=False)
        results = run_all(stack.addr("gateway"), [long] * 4)
        refused = [r for r in results if isinstance(r, grpc.RpcError)]
        assert len(refused) == 2 and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
        assert all("concurrent streams" in r.details() for r in refused)
