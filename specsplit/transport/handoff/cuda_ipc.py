"""CUDA IPC ring: the GPU backend (same host; the reader may sit on the same GPU or another one).

The writer allocates one ring tensor [capacity, 3H] on its CUDA device and exports it
once, through PyTorch's own CUDA IPC path (`torch.multiprocessing.reductions.reduce_tensor`,
i.e. `UntypedStorage._share_cuda_`: a cudaIpcMemHandle of the allocation, the ring's
offset in it, PyTorch's IPC reference counter, and an IPC event). What the reader needs
travels as `Descriptor.handle`: plain JSON with the binary handles base64-encoded, so the
reader never unpickles anything that came over the wire.

The reader maps the ring once, at construction (`rebuild_cuda_tensor`, which calls
cudaIpcOpenMemHandle with lazy peer access), and then only copies slices out of it.
The mapping lives on the writer's device index in the reader's process, so both processes
must number the GPUs alike (same CUDA_VISIBLE_DEVICES); the handle carries the GPU's UUID and
the reader refuses a mismatch. A reader in the writer's own process (CUDA cannot open
its own IPC handles) uses the ring tensor directly.

Lifetime follows PyTorch's IPC reference counting: the export counts one consumer; a
reader in another process gives it back when it closes (or exits), and the writer's block
is only reused after that. A writer whose ring no other process ever opened (or that exits
before its readers) therefore makes PyTorch print "Producer process has been terminated
before all shared CUDA tensors released" at exit; that warning is harmless.

Completion, both ends:
- `write` (`write_all`: a step's rows at once) copies the rows on the current stream of the
  ring's device and then synchronizes that stream once (a cross-device source is ordered before
  it by PyTorch's copy barrier), so the rows are in GPU memory when it returns and a reference
  may be sent.
- `read` copies the slice to the reader's device on the current stream of the ring's device
  (where PyTorch runs device-to-device copies) and synchronizes that stream, so the copy is
  complete when `read` returns and the slot may be acknowledged and reused.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import weakref

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from specsplit.transport.handoff.base import DTYPES, Allocation, Descriptor, RingAllocator, dtype_name

HANDLE_VERSION = 1

# rings of this process, by name: a reader in the writer's process cannot open its own IPC handle
_LOCAL_RINGS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def _cuda_device(device: str | int | torch.device | None) -> torch.device:
    dev = torch.device("cuda" if device is None else (f"cuda:{device}" if isinstance(device, int) else device))
    if dev.type != "cuda":
        raise ValueError(f"the cuda_ipc backend needs a CUDA device, got {dev}")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def _gpu_uuid(index: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode("ascii")


def _unb64(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)


def _export(ring: torch.Tensor) -> bytes:
    rebuild, args = reduce_tensor(ring)
    if rebuild is not rebuild_cuda_tensor or len(args) != 15:
        raise RuntimeError("this PyTorch shares CUDA tensors in an unexpected form; cuda_ipc cannot export the ring")
    (_, size, stride, tensor_offset, _, _, storage_device, storage_handle, storage_size_bytes, storage_offset_bytes,
     _, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    return json.dumps({
        "version": HANDLE_VERSION,
        "pid": os.getpid(),
        "uuid": _gpu_uuid(storage_device),
        "size": list(size),
        "stride": list(stride),
        "tensor_offset": tensor_offset,
        "storage_device": storage_device,
        "storage_handle": _b64(storage_handle),
        "storage_size_bytes": storage_size_bytes,
        "storage_offset_bytes": storage_offset_bytes,
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": ref_counter_offset,
        "event_handle": _b64(event_handle),
        "event_sync_required": bool(event_sync_required),
    }).encode()


class CudaIpcWriter:
    def __init__(self, capacity_rows: int, width: int, dtype: torch.dtype,
                 device: str | int | torch.device | None = None) -> None:
        self.device = _cuda_device(device)
        name = f"specsplit-cuda-{secrets.token_hex(6)}"
        self.ring = torch.zeros(capacity_rows, width, dtype=dtype, device=self.device)  # [capacity, 3H]
        torch.cuda.current_stream(self.device).synchronize()
        handle = _export(self.ring)  # once: every reader maps this same allocation
        _LOCAL_RINGS[name] = self.ring
        self.descriptor = Descriptor("cuda_ipc", name, capacity_rows, width, dtype_name(dtype),
                                     handle=handle, device=self.device.index)
        self.allocator = RingAllocator(capacity_rows)

    def allocate(self, rows: int) -> Allocation | None:
        return self.allocator.allocate(rows)

    def write(self, alloc: Allocation, rows: torch.Tensor) -> None:
        # rows [n <= alloc.rows, width], any device/dtype; complete in GPU memory once this returns
        self.write_all([(alloc, rows)])

    def write_all(self, items: list[tuple[Allocation, torch.Tensor]]) -> None:
        """Every (allocation, rows) of a step: the copies, then one synchronisation."""
        for alloc, rows in items:
            if rows.shape[0] > alloc.rows:
                raise ValueError(f"{rows.shape[0]} rows do not fit an allocation of {alloc.rows}")
            self.ring[alloc.offset : alloc.offset + rows.shape[0]].copy_(rows)
        torch.cuda.current_stream(self.device).synchronize()

    def ring_on(self, device: torch.device) -> torch.Tensor | None:
        """The ring, for a step on its own device that writes its rows itself (complete once that
        step's stream has passed the writes, as `write_all` leaves them)."""
        return self.ring if device == self.device else None

    def release(self, generation: int) -> None:
        self.allocator.release(generation)

    def close(self) -> None:
        _LOCAL_RINGS.pop(self.descriptor.name, None)
        del self.ring  # PyTorch keeps the block out of reuse until every reader has let go
        torch.cuda.ipc_collect()


class CudaIpcReader:
    def __init__(self, desc: Descriptor, device: str | int | torch.device | None = None) -> None:
        info = json.loads(desc.handle.decode())
        if info.get("version") != HANDLE_VERSION:
            raise ValueError(f"cuda_ipc handle version {info.get('version')!r}, this reader reads {HANDLE_VERSION}")
        self.device = torch.device(f"cuda:{desc.device}") if device is None else (
            torch.device(f"cuda:{device}") if isinstance(device, int) else torch.device(device))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        dtype = DTYPES[desc.dtype]
        local = _LOCAL_RINGS.get(desc.name) if info["pid"] == os.getpid() else None
        if local is not None:
            self.ring = local
        else:
            src = info["storage_device"]
            if src >= torch.cuda.device_count() or _gpu_uuid(src) != info["uuid"]:
                raise RuntimeError(f"the writer's ring is on its cuda:{src} ({info['uuid']}), which this process "
                                   "does not see under that index; run both with the same CUDA_VISIBLE_DEVICES")
            self.ring = rebuild_cuda_tensor(
                torch.Tensor, torch.Size(info["size"]), tuple(info["stride"]), info["tensor_offset"],
                torch.storage.TypedStorage, dtype, src, _unb64(info["storage_handle"]),
                info["storage_size_bytes"], info["storage_offset_bytes"], False,
                _unb64(info["ref_counter_handle"]), info["ref_counter_offset"],
                _unb64(info["event_handle"]), info["event_sync_required"])
        if tuple(self.ring.shape) != (desc.capacity_rows, desc.width):
            raise ValueError(f"mapped ring is {tuple(self.ring.shape)}, descriptor says "
                             f"{(desc.capacity_rows, desc.width)}")
        self.opens = 1

    def read(self, offset: int, rows: int, inline: bytes = b"") -> torch.Tensor:
        if offset < 0 or rows < 0 or offset + rows > self.ring.shape[0]:
            raise ValueError(f"reference [{offset}, {offset + rows}) outside the ring")
        # a view where the ring is on the reader's device, else a copy queued there: either holds the rows only
        # until the read is acknowledged (the writer reuses them then), so the reader's stream must pass its uses
        # before it replies (the draft's readback of its proposals does)
        return self.ring[offset : offset + rows].to(self.device)

    def ring_on(self, device: torch.device) -> torch.Tensor | None:
        return self.ring if self.ring.device == device else None

    def close(self) -> None:
        del self.ring  # reads live within a step, so this drops the last use: PyTorch unmaps, releases the counter
