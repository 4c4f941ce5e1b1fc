"""Requests waiting for a KV slot, and the order they get one in: the oldest request of the
client that runs the fewest sequences goes first, so one client's backlog never stands
between another client and the next free slot. `push` runs on the servers' event loop and
the rest on the speculation loop's: every change holds the lock."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

from gateway.sequence import QueueFull, Sequence


class WaitingQueue:
    def __init__(self, max_queue: int, max_per_client: int) -> None:
        self.max_queue, self.max_per_client = max_queue, max_per_client
        self._seqs: list[Sequence] = []  # in arrival order
        self._per_client: Counter[str] = Counter()
        self._lock = threading.Lock()

    def push(self, seq: Sequence, free_slots: int) -> None:
        """Queue a request, or raise QueueFull: beyond `max_queue` waiting in all, or beyond
        `max_per_client` of its client (requests that will take one of the `free_slots` at the
        next cycle do not count)."""
        client = seq.req.client
        with self._lock:
            if len(self._seqs) >= self.max_queue + free_slots:
                raise QueueFull(f"{len(self._seqs) - free_slots} requests already waiting")
            if self._per_client[client] >= self.max_per_client + free_slots:
                raise QueueFull(f"this client has {self._per_client[client]} requests waiting already "
                                f"(at most {self.max_per_client})")
            self._seqs.append(seq)
            self._per_client[client] += 1

    def pop_fair(self, running: Counter[str]) -> Sequence | None:
        """The next request to admit: the oldest of the client with the fewest `running`."""
        with self._lock:
            best = self._fair(running)
            if best is None:
                return None
            seq = self._seqs.pop(best)
            self._forget(seq)
            return seq

    def peek_fair(self, running: Counter[str]) -> Sequence | None:
        """The request pop_fair would give."""
        with self._lock:
            best = self._fair(running)
            return None if best is None else self._seqs[best]

    def _fair(self, running: Counter[str]) -> int | None:
        if not self._seqs:
            return None
        return min(range(len(self._seqs)), key=lambda i: (running[self._seqs[i].req.client], i))

    def push_front(self, seq: Sequence) -> None:
        """Back at the head of the queue (a prefill refused for want of room: retried next cycle)."""
        with self._lock:
            self._seqs.insert(0, seq)
            self._per_client[seq.req.client] += 1

    def remove(self, seq: Sequence) -> bool:
        with self._lock:
            if seq not in self._seqs:
                return False
            self._seqs.remove(seq)
            self._forget(seq)
            return True

    def take_all(self) -> list[Sequence]:
        with self._lock:
            seqs, self._seqs = self._seqs, []
            self._per_client.clear()
            return seqs

    def _forget(self, seq: Sequence) -> None:
        self._per_client[seq.req.client] -= 1
        if not self._per_client[seq.req.client]:
            del self._per_client[seq.req.client]

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs

    def __iter__(self) -> Iterator[Sequence]:
        with self._lock:
            return iter(list(self._seqs))
