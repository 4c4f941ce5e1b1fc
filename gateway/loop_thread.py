"""An event loop on a thread of its own: the gateway runs the speculation loop, its clients
of the two services and the recovery task there, and serves the public API on the main
thread's loop. A step's round trip then meets no client work (streaming tokens, new calls,
health checks): those run on the other thread while the loop waits for a service, with the
GIL released."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()  # uvloop's, once specsplit.transport.serving.install_uvloop ran
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> LoopThread:
        self.thread.start()
        return self

    def _main(self) -> None:
        if sys.platform == "linux":  # the OS thread's name too, for top -H and /proc/PID/task/*/comm
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None).prctl(15, self.thread.name.encode()[:15])  # PR_SET_NAME
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run coro on this thread's loop; await its result from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout_s)
