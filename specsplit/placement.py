"""Where a service computes, as the gateway compares placements: a GPU by its UUID (one GPU
seen by two containers through different CUDA_VISIBLE_DEVICES has one UUID), else "cpu". And
the one placement choice made from them: drafting ahead (gateway.ahead)."""

from __future__ import annotations

import torch

DRAFT_AHEAD = ("auto", "on", "off")


def device_identity(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"cuda GPU-{uuid}" if uuid is not None else f"cuda:{index}"


def draft_ahead_on(choice: str, target_device: str, draft_device: str) -> bool:
    """`choice` 'auto': on when the draft computes on a GPU of its own, where drafting ahead
    takes nothing from the target (on a shared GPU or CPU the two compete for it)."""
    if choice != "auto":
        return choice == "on"
    return draft_device.startswith("cuda") and target_device.startswith("cuda") and draft_device != target_device
