"""Self-distillation data: the target's own responses to the prompts, generated in large
batches (prompts sorted by length, left-padded, one static KV cache per batch)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specsplit.training.target import BatchedTarget


@dataclass
class Sample:
    ids: torch.Tensor  # [L] int64 on the CPU: prompt then response (EOS included when it came)
    prompt_len: int


@dataclass
class GenStats:
    prompts: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    batches: int = 0
    stopped_early: bool = False  # the deadline came before every prompt had its response

    def new_tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {"prompts": self.prompts, "new_tokens": self.new_tokens, "seconds": round(self.seconds, 2),
                "batches": self.batches, "stopped_early": self.stopped_early,
                "new_tokens_per_s": round(self.new_tokens_per_s(), 1)}


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> next tokens [B]: argmax, or a sample at `temperature`."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


@torch.inference_mode()
def generate_batch(target: BatchedTarget, prompts: list[list[int]], max_new: int, eos_ids: list[int],
                   temperature: float = 0.0, gen: torch.Generator | None = None) -> list[Sample]:
    dev = target.device
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    b, p = len(prompts), int(lens.max())
    tokens = torch.zeros(b, p, dtype=torch.long)
    for i, ids in enumerate(prompts):
        tokens[i, p - len(ids):] = torch.tensor(ids)
    tokens, pad = tokens.to(dev), p - lens
    s = p + max_new
    cache = target.new_cache(b, s)
    cols = torch.arange(s, device=dev)
    valid = cols[None, :] >= pad[:, None]  # [B, S]: the padding columns are never attended
    eos = torch.tensor(eos_ids or [-1], device=dev)
    out = torch.zeros(b, max_new, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    nxt = _pick(target.logits(target.prefill(tokens, pad, cache)), temperature, gen)
    steps = 0
    for t in range(max_new):
        out[:, t] = nxt
        done |= torch.isin(nxt, eos)
        steps = t + 1
        if t == max_new - 1 or (t % 16 == 15 and bool(done.all())):  # a host sync every 16 steps only
            break
        normed = target.decode(nxt, lens + t, p + t, valid & (cols[None, :] <= p + t), cache)
        nxt = _pick(target.logits(normed), temperature, gen)
    out = out[:, :steps].cpu()
    samples = []
    for i, ids in enumerate(prompts):
        resp = out[i]
        hit = torch.isin(resp, eos.cpu()).nonzero()
        n = int(hit[0]) + 1 if len(hit) else steps
        samples.append(Sample(torch.cat([torch.tensor(ids, dtype=torch.long), resp[:n]]), len(ids)))
    return samples


def generate_all(target: BatchedTarget, prompts: list[list[int]], max_new: int, batch_size: int,
                 eos_ids: list[int], temperature: float = 0.0, seed: int = 0, deadline: float | None = None,
                 on_batch: Callable[[int, int, GenStats], None] | None = None) -> tuple[list[Sample], GenStats]:
    """Generate for every prompt until done or `deadline` (time.monotonic()); returns the
    samples made and the throughput. Prompts are taken in their order, in windows of eight
    batches, each window sorted by length (a batch shares its length): a deadline then
    drops a tail of the given order, not the shortest or the longest prompts."""
    gen = torch.Generator(device=target.device).manual_seed(seed) if temperature > 0 else None
    window = 8 * batch_size
    order = [i for w in range(0, len(prompts), window)
             for i in sorted(range(w, min(w + window, len(prompts))), key=lambda i: -len(prompts[i]))]
    stats, samples, t0 = GenStats(), [], time.monotonic()
    for start in range(0, len(order), batch_size):
        if deadline is not None and time.monotonic() >= deadline:
            stats.stopped_early = True
            break
        batch = generate_batch(target, [prompts[i] for i in order[start:start + batch_size]], max_new, eos_ids,
                               temperature, gen)
        samples += batch
        stats.prompts += len(batch)
        stats.new_tokens += sum(len(s.ids) - s.prompt_len for s in batch)
        stats.batches += 1
        stats.seconds = time.monotonic() - t0
        if on_batch is not None:
            on_batch(stats.prompts, len(prompts), stats)
    stats.seconds = time.monotonic() - t0
    return samples, stats
