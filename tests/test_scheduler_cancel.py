"""Scheduler.cancel on a request that never left the queue: it ends at once, with no cycle."""

from __future__ import annotations

from gateway.scheduler import Finished, GenerationRequest, Limits, Scheduler
from specsplit.ops import Sampling


def test_cancelling_a_waiting_request_ends_it_at_once() -> None:
    scheduler = Scheduler(target=None, draft=None, max_sequences=1, limits=Limits(max_queue=4))  # type: ignore[arg-type]
    req = GenerationRequest([1, 2, 3], 4, Sampling(), set(), 0)
    first, second = scheduler.submit(req), scheduler.submit(req)
    scheduler.cancel(second)
    assert list(scheduler.waiting) == [first]
    assert second.done and second.events.get_nowait() == Finished("abort")
    scheduler.cancel(second)  # again: nothing more happens
    assert second.events.empty()
