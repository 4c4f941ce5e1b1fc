"""The speculation loop against engines that answer at once or hang: stop() always ends it,
and a step slower than step_timeout_s counts as that service failing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from bench.scheduler_cpu import InstantDraft, InstantTarget
from gateway.scheduler import Failed, Finished, GenerationRequest, Limits, Scheduler, Sequence
from specsplit.ops import Sampling


def request(max_new_tokens: int, num_steps: int = 3) -> GenerationRequest:
    return GenerationRequest([1, 2, 3], max_new_tokens, Sampling(), set(), num_steps)


async def drain(seq) -> tuple[list[int], object]:  # noqa: ANN001
    tokens: list[int] = []
    while True:
        ev = await seq.events.get()
        if isinstance(ev, list):
            tokens += ev
        else:
            return tokens, ev


def test_stop_ends_the_loop_even_when_steps_answer_at_once() -> None:
    """Python 3.11's wait_for could swallow the cancel of a step that had just finished, so that
    stop() waited for ever; 200 stops in the middle of generations must all return."""

    async def main() -> None:
        for _ in range(200):
            s = Scheduler(InstantTarget(), InstantDraft(), max_sequences=4, limits=Limits(max_queue=8))
            s.draft_restored()
            s.start()
            s.submit(request(10_000))
            for _ in range(3):
                await asyncio.sleep(0)
            await asyncio.wait_for(s.stop(), 5.0)
            assert s.task is not None and s.task.done()

    asyncio.run(main())


def test_a_draft_step_past_the_timeout_leaves_the_stream_target_only() -> None:
    async def main() -> tuple[list[int], object, bool]:
        draft = InstantDraft()
        quick = Limits(max_queue=8, step_timeout_s=0.2, draft_timeout_s=0.2)
        s = Scheduler(InstantTarget(), draft, max_sequences=4, limits=quick)
        s.draft_restored()
        s.start()
        seq = s.submit(request(12))
        first = await seq.events.get()  # the prefill's token
        draft.hang = True
        tokens, end = await asyncio.wait_for(drain(seq), 10.0)
        await s.stop()
        return [*first, *tokens], end, s.draft_down

    tokens, end, draft_down = asyncio.run(main())
    assert draft_down and end == Finished("length") and len(tokens) == 12


def test_a_target_step_past_the_timeout_fails_the_stream_unavailable() -> None:
    async def main() -> object:
        target = InstantTarget()
        quick = Limits(max_queue=8, step_timeout_s=0.2, draft_timeout_s=0.2)
        s = Scheduler(target, InstantDraft(), max_sequences=4, limits=quick)
        s.draft_restored()
        s.start()
        seq = s.submit(request(10_000))
        await seq.events.get()
        target.hang = True
        _, end = await asyncio.wait_for(drain(seq), 10.0)
        await s.stop()
        return end

    end = asyncio.run(main())
    assert isinstance(end, Failed) and end.code == grpc.StatusCode.UNAVAILABLE


def test_the_loop_lets_others_run_between_cycles_when_clients_never_suspend() -> None:
    """The in-process clients (LocalTarget/LocalDraft) return without suspending: the loop must
    still give the event loop a turn every cycle (submissions, cancels, recovery callbacks)."""

    async def main() -> tuple[int, int]:
        s = Scheduler(InstantTarget(suspend=False), InstantDraft(suspend=False), max_sequences=4,
                      limits=Limits(max_queue=8, stream_buffer=1 << 30))  # nobody reads the stream here
        s.draft_restored()
        s.start()
        seq = s.submit(request(4_000))
        turns = 0
        while not seq.done:
            await asyncio.sleep(0)
            turns += 1
        await s.stop()
        return turns, s.cycles

    turns, cycles = asyncio.run(main())
    assert cycles > 900 and turns >= cycles - 1


def test_a_loop_on_its_own_thread_serves_submitters_on_another_loop() -> None:
    """The gateway's default: the loop on a LoopThread, the servicers on the main loop. Every
    stream gets all its tokens in order on its own loop; cancels from the main loop end
    waiting and running sequences; stop() from the main loop ends it."""
    from gateway.loop_thread import LoopThread

    async def main() -> None:
        loop_thread = LoopThread("spec-loop").start()
        s = Scheduler(InstantTarget(), InstantDraft(), max_sequences=2, limits=Limits(max_queue=64))

        async def start() -> None:
            s.draft_restored()
            s.start()

        await loop_thread.run(start())
        assert s.loop is loop_thread.loop
        seqs = [s.submit(request(50 + i)) for i in range(6)]  # 2 run, 4 wait
        doomed = s.submit(request(10_000))
        s.cancel(doomed)  # still waiting, or admitted meanwhile: either way it ends, aborted
        results = await asyncio.wait_for(asyncio.gather(*(drain(q) for q in seqs), drain(doomed)), 30.0)
        for i, (tokens, end) in enumerate(results[:-1]):
            # a prefill token, then cycles of drafts 1..3 and the bonus 9, cut at the length
            expected = [9, *([1, 2, 3, 9] * 20)][: 50 + i]
            assert tokens == expected and end == Finished("length")
        assert results[-1][1] == Finished("abort")
        running = s.submit(request(10_000))
        await running.events.get()
        s.cancel(running)
        assert (await asyncio.wait_for(drain(running), 10.0))[1] == Finished("abort")
        await asyncio.wait_for(loop_thread.run(s.stop()), 5.0)
        loop_thread.stop()
        assert not loop_thread.thread.is_alive()

    asyncio.run(main())


def test_requests_submitted_before_the_loop_admits_them_count_free_slots() -> None:
    """max_queue bounds the requests waiting for a KV slot: with the loop on its own thread,
    several requests can be submitted before it admits any, and those that free slots will
    take at the next cycle are not refused (tests/test_load.py saw that race)."""
    from gateway.scheduler import QueueFull

    async def main() -> list[object]:
        s = Scheduler(InstantTarget(), InstantDraft(), max_sequences=2,
                      limits=Limits(max_queue=1, max_queued_per_client=1))
        s.draft_restored()
        seqs = [s.submit(request(5)) for _ in range(3)]  # not started yet: 2 free slots + 1 queued
        with pytest.raises(QueueFull):
            s.submit(request(5))
        s.start()
        ends = await asyncio.wait_for(asyncio.gather(*(drain(q) for q in seqs)), 30.0)
        await s.stop()
        return [end for _, end in ends]

    assert asyncio.run(main()) == [Finished("length")] * 3


def test_the_next_free_slot_goes_to_the_client_running_the_fewest() -> None:
    """Client A runs in both slots with 4 more queued; client B's request, queued after them,
    takes the next slot (A's youngest is suspended for it, see the next test), before A's backlog."""

    async def main() -> list[object]:
        s = Scheduler(InstantTarget(), InstantDraft(), max_sequences=2, limits=Limits(max_queue=8))
        admitted = record_admissions(s)
        s.draft_restored()
        s.start()
        a = [s.submit(GenerationRequest([1, 2, 3], 40 + 8 * i, Sampling(), set(), 3, client="a")) for i in range(6)]
        await a[0].events.get()
        await a[1].events.get()  # both slots taken by A
        b = s.submit(GenerationRequest([1, 2, 3], 20, Sampling(), set(), 3, client="b"))
        await asyncio.wait_for(asyncio.gather(*(drain(q) for q in [*a, b])), 30.0)
        await s.stop()
        return admitted

    order = asyncio.run(main())
    assert order[:3] == ["a", "a", "b"] and order.count("b") == 1 and order.count("a") >= 6


def test_a_client_queue_limit_refuses_its_requests_only() -> None:
    from gateway.scheduler import QueueFull

    s = Scheduler(InstantTarget(), InstantDraft(), max_sequences=1,
                  limits=Limits(max_queue=100, max_queued_per_client=2))
    for _ in range(3):  # one takes the free slot at the next cycle, two wait
        s.submit(GenerationRequest([1], 5, Sampling(), set(), 0, client="greedy"))
    with pytest.raises(QueueFull, match="this client"):
        s.submit(GenerationRequest([1], 5, Sampling(), set(), 0, client="greedy"))
    s.submit(GenerationRequest([1], 5, Sampling(), set(), 0, client="other"))


def test_a_sequence_whose_stream_is_not_read_waits_then_ends() -> None:
    """Past `stream_buffer` unread tokens the sequence is not stepped (the other goes on); past
    `unread_timeout_s` it ends with RESOURCE_EXHAUSTED, its slot free."""

    async def main() -> tuple[object, list[int], object]:
        s = Scheduler(InstantTarget(), InstantDraft(), max_sequences=2,
                      limits=Limits(max_queue=8, stream_buffer=16, unread_timeout_s=0.5))
        s.draft_restored()
        s.start()
        unread = s.submit(request(10_000))
        read = s.submit(request(200))
        read_out = await asyncio.wait_for(drain_taken(s, read), 30.0)
        end = await asyncio.wait_for(last_event(unread), 30.0)
        await s.stop()
        return end, read_out[0], read_out[1]

    end, tokens, read_end = asyncio.run(main())
    assert isinstance(end, Failed) and end.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(tokens) == 200 and read_end == Finished("length")


async def drain_taken(s: Scheduler, seq) -> tuple[list[int], object]:  # noqa: ANN001
    """drain, telling the scheduler what was taken (as the gateway's stream handler does)."""
    tokens: list[int] = []
    while True:
        ev = await seq.events.get()
        if not isinstance(ev, list):
            return tokens, ev
        s.taken(seq, len(ev))
        tokens += ev


async def last_event(seq) -> object:  # noqa: ANN001
    while True:
        ev = await seq.events.get()
        if not isinstance(ev, list):
            return ev


def test_a_client_running_two_fewer_takes_a_slot_back() -> None:
    """No slot free: the youngest sequence of the client running the most is suspended for a
    client running none, resumed once a slot frees; every stream still gets all its tokens."""

    async def main() -> tuple[list[object], list[tuple[list[int], object]]]:
        s = Scheduler(InstantTarget(), InstantDraft(), max_sequences=2, limits=Limits(max_queue=8))
        admitted = record_admissions(s, resumed=True)
        s.draft_restored()
        s.start()
        a = [s.submit(GenerationRequest([1, 2, 3], 400 + i, Sampling(), set(), 3, client="a")) for i in range(2)]
        for q in a:
            await q.events.get()
        b = s.submit(GenerationRequest([1, 2, 3], 20, Sampling(), set(), 3, client="b"))
        ends = await asyncio.wait_for(asyncio.gather(*(drain(q) for q in [*a, b])), 30.0)
        await s.stop()
        return admitted, ends

    admitted, ends = asyncio.run(main())
    assert admitted == [("a", False), ("a", False), ("b", False), ("a", True)]
    assert [len(t) for t, _ in ends] == [399, 400, 20] and all(e == Finished("length") for _, e in ends)


def record_admissions(s: Scheduler, resumed: bool = False) -> list[object]:
    """Each cycle's newcomers in admission order (their client; with `resumed`, also whether
    the sequence was suspended), seen through the scheduler's cycle-span hook."""
    admitted: list[object] = []

    class Hook:
        def open(self, running: list, newcomers: list) -> list:
            admitted.extend((x.req.client, x.suspended) if resumed else x.req.client for x in newcomers)
            return []

        def close(self, traced: list, outbox: object) -> None:
            pass

    s.spans = Hook()  # type: ignore[assignment]
    return admitted


def watched_engines(watch: Callable[[str, Callable[[], None]], None]) -> tuple[InstantTarget, InstantDraft]:
    """Stub engines that never suspend (a reader does not run during a call) and whose calls run
    watch(service, meanwhile) in place of the loop's meanwhile."""

    def wrap(service: str, meanwhile: Callable[[], None] | None) -> Callable[[], None] | None:
        return None if meanwhile is None else lambda: watch(service, meanwhile)

    class Target(InstantTarget):
        async def step(self, ops, releases, timeout=0.0, meanwhile=None):  # noqa: ANN001, ANN202
            return await super().step(ops, releases, timeout, wrap("target", meanwhile))

    class Draft(InstantDraft):
        async def step(self, ops, timeout=0.0, meanwhile=None):  # noqa: ANN001, ANN202
            return await super().step(ops, timeout, wrap("draft", meanwhile))

    return Target(suspend=False), Draft(suspend=False)


def test_a_cycles_tokens_reach_their_reader_while_the_next_call_computes() -> None:
    """A cycle's tokens wait until the next step request is sent and go out before its reply is
    read (gateway.outbox): each verify's tokens with the next draft call, none with a target call
    (whose cycle's draft call took them); each stream's events keep their order, none is lost."""
    delivered: list[tuple[str, int]] = []  # (service, events handed to the reader during its call)

    def watch(service: str, meanwhile: Callable[[], None]) -> None:
        assert seq is not None
        before = seq.events.qsize()  # the reader does not run during a call: suspend=False
        meanwhile()
        delivered.append((service, seq.events.qsize() - before))

    async def main() -> tuple[list[int], object]:
        nonlocal seq
        s = Scheduler(*watched_engines(watch), max_sequences=2, limits=Limits(max_queue=8))
        s.draft_restored()
        s.start()
        seq = s.submit(request(13, num_steps=3))
        out = await asyncio.wait_for(drain(seq), 10.0)
        await s.stop()
        return out

    seq: Sequence | None = None
    tokens, end = asyncio.run(main())
    assert tokens == ([9] + [1, 2, 3, 9] * 4)[:13] and end == Finished("length")
    assert delivered == [("target", 0), ("draft", 1), ("target", 0), ("draft", 1), ("target", 0), ("draft", 1),
                         ("target", 0), ("draft", 2), ("target", 0)]  # prefill, 3 verifies; the last: tokens, end


def test_a_cycles_bookkeeping_is_done_while_the_next_call_computes() -> None:
    """Between a reply and the next request the loop does only what that request needs: a
    verify's statistics and a draft call's times are recorded during the next call, and a
    reader handed the sequence's end finds them whole."""
    seen: list[tuple[str, int, int]] = []  # (service, verify cycles with statistics before / after its meanwhile)

    def watch(service: str, meanwhile: Callable[[], None]) -> None:
        assert seq is not None
        before = sum(seq.stats.histogram.values())
        meanwhile()
        seen.append((service, before, sum(seq.stats.histogram.values())))

    async def main() -> tuple[list[int], object, tuple[int, dict[int, int], int, float]]:
        nonlocal seq
        s = Scheduler(*watched_engines(watch), max_sequences=2, limits=Limits(max_queue=8))
        s.draft_restored()
        s.start()
        seq = s.submit(request(13, num_steps=3))
        tokens, end = await asyncio.wait_for(drain(seq), 10.0)
        st = seq.stats  # as the reader finds them on the end
        whole = (st.cycles, dict(st.histogram), st.draft_tokens, st.draft_ms)
        await s.stop()
        return tokens, end, whole

    seq: Sequence | None = None
    tokens, end, (cycles, histogram, draft_tokens, draft_ms) = asyncio.run(main())
    assert tokens == ([9] + [1, 2, 3, 9] * 4)[:13] and end == Finished("length")
    # the prefill, a draft call, then 3 verifies, each recorded during the next (draft) call; the last
    # draft call releases the sequence, the last target call too
    assert seen == [("target", 0, 0), ("draft", 0, 0), ("target", 0, 0), ("draft", 0, 1), ("target", 1, 1),
                    ("draft", 1, 2), ("target", 2, 2), ("draft", 2, 3), ("target", 3, 3)]
    assert cycles == 3 and histogram == {4: 3} and draft_tokens == 9 and draft_ms > 0
