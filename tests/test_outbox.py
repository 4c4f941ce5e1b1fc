"""The readers' events (gateway.outbox): held until delivered, then handed over in order, to a
reader on another thread's loop with one wake-up of that loop per delivery."""

from __future__ import annotations

import asyncio
import threading

from gateway.outbox import Outbox
from gateway.sequence import Finished, GenerationRequest, Sequence
from specsplit.ops import Sampling


def test_events_wait_then_reach_readers_on_another_loop_in_order() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    req = GenerationRequest([1, 2], 8, Sampling(), set(), 0)
    seqs = [Sequence(i, req) for i in range(3)]
    for s in seqs:
        s.loop = loop  # their readers run on the other thread's loop
    wakeups = 0
    call_soon_threadsafe = loop.call_soon_threadsafe

    def counting(*args: object) -> object:
        nonlocal wakeups
        wakeups += 1
        return call_soon_threadsafe(*args)  # type: ignore[arg-type]

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    box = Outbox()
    for step in range(4):
        for s in seqs:
            box.post(s, [10 * s.seq_id + step], now=False)
    box.post(seqs[1], Finished("length"), now=False)
    assert all(s.events.qsize() == 0 for s in seqs) and wakeups == 0  # held
    box.deliver()
    box.deliver()  # nothing left: no wake-up
    assert wakeups == 1

    async def read(s: Sequence) -> list[object]:
        return [await s.events.get() for _ in range(s.posted + (s is seqs[1]))]

    got = [asyncio.run_coroutine_threadsafe(read(s), loop).result(timeout=5) for s in seqs]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    assert got[0] == [[0], [1], [2], [3]] and got[2] == [[20], [21], [22], [23]]
    assert got[1] == [[10], [11], [12], [13], Finished("length")]
    box.post(seqs[0], [99], now=True)  # outside a cycle: at once (its loop has stopped: nobody reads, no error)
    assert box.events == []


def test_work_put_off_runs_at_the_next_delivery_in_order_before_the_events(caplog) -> None:  # noqa: ANN001
    """The loop's bookkeeping (`later`) runs when the events go out, first and in the order it was
    put off; a piece that fails is logged and the rest still runs, the events still go out."""
    box = Outbox()
    s = Sequence(0, GenerationRequest([1, 2], 8, Sampling(), set(), 0))
    done: list[object] = []

    def fails() -> None:
        raise ValueError("a bug in the bookkeeping")

    box.post(s, [5], now=False)
    box.later(done.append, "a")
    box.later(fails)
    box.later(lambda: done.append(s.events.qsize()))  # the events are not handed over yet
    assert done == []  # put off
    box.deliver()
    assert done == ["a", 0] and s.events.get_nowait() == [5]
    assert "bookkeeping failed" in caplog.text
    box.later(done.append, "b")
    box.post(s, Finished("stop"), now=True)  # outside a cycle: the work, then the event, at once
    assert done == ["a", 0, "b"] and s.events.get_nowait() == Finished("stop")
