"""Events on their way to the sequences' readers, and the loop's bookkeeping that no call waits
for. A cycle's tokens (and ends) wait in the outbox until the next step request to a service is
sent, and go out while that service computes: handing an event to a reader on another thread's
loop wakes that thread, whose streaming would otherwise compete for the GIL with the loop
between its two calls; each other loop is woken once per delivery, for all its readers' events.
Events posted outside a cycle go out at once, after any still waiting, so that each reader sees
its events in order.

The bookkeeping (a cycle's statistics, its spans' attributes and ends, metrics) waits the same
way (`later`) and runs first at each delivery, in the order it was put off: between a reply and
the next request the loop only does what that request needs, and a reader handed a sequence's
end finds its statistics whole."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.sequence import Failed, Finished, Sequence

log = logging.getLogger("specsplit.gateway")


class Outbox:
    def __init__(self) -> None:
        self.events: list[tuple[Sequence, list[int] | Finished | Failed]] = []
        self.work: list[tuple[Callable[..., None], tuple[Any, ...]]] = []  # bookkeeping put off
        self.delivered = False  # since `cycle_started`

    def later(self, fn: Callable[..., None], *args: Any) -> None:
        """fn(*args) at the next delivery, before its events (the loop's thread)."""
        self.work.append((fn, args))

    def post(self, seq: Sequence, event: list[int] | Finished | Failed, now: bool) -> None:
        """`event` for the sequence's reader: at once with `now`, else with the next delivery."""
        if isinstance(event, list):
            seq.posted += len(event)
        self.events.append((seq, event))
        if now:
            self.deliver()

    def cycle_started(self) -> None:
        self.delivered = False

    def deliver(self) -> None:
        """The bookkeeping put off, then every waiting event to its reader, on the reader's loop
        (the `meanwhile` of a step call)."""
        self.delivered = True
        while self.work:
            work, self.work = self.work, []
            for fn, args in work:
                try:
                    fn(*args)
                except Exception:  # a fault of the bookkeeping is no fault of the call it overlaps
                    log.exception("the loop's bookkeeping failed")
        if not self.events:
            return
        events, self.events = self.events, []
        running = asyncio._get_running_loop()
        elsewhere: dict[asyncio.AbstractEventLoop, list[tuple[Sequence, list[int] | Finished | Failed]]] = {}
        for seq, event in events:
            loop = seq.loop
            if loop is None or loop is running:
                seq.events.put_nowait(event)
            else:
                elsewhere.setdefault(loop, []).append((seq, event))
        for loop, batch in elsewhere.items():  # one wake-up of each other loop, its events in order
            with contextlib.suppress(RuntimeError):  # the reader's loop has closed: nobody reads
                loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[Sequence, list[int] | Finished | Failed]]) -> None:
    for seq, event in batch:
        seq.events.put_nowait(event)
