"""Hidden-state handoff from the target to the draft: one interface, several backends.

The target (writer) owns a ring of rows [capacity, 3H]; every prefill/verify reply
carries a HiddenRef {offset, rows, generation}; the draft (reader) maps the ring once
and reads rows by reference; space is reclaimed only when the draft's consumption of a
generation has been acknowledged. Backends: "shm" (POSIX shared memory, CPU),
"inline" (rows inside the message, for hosts without shared memory) and "cuda_ipc"
(a ring in the target's GPU memory, mapped by the draft through CUDA IPC, same host).
"""

from specsplit.transport.handoff.base import Allocation, HiddenReader, HiddenWriter, RingAllocator
from specsplit.transport.handoff.factory import open_reader, open_writer

__all__ = ["Allocation", "HiddenReader", "HiddenWriter", "RingAllocator", "open_reader", "open_writer"]
