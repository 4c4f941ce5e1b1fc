"""The draft -> verify loop at batch 1 as a plain Python loop over the two runtimes in one
process: no gRPC, no scheduler, no asyncio. The in-process reference the services are
measured against (bench.cycle_overhead) and the fastest target-only decoding we have."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

from bench.replay import Replayer
from draft_service.runtime import DraftRuntime
from specsplit.forced import ForcedAcceptance
from specsplit.ops import ExtendPropose, Prefill, Release, Verify
from target_service.runtime import TargetRuntime

_ids = itertools.count(1_000_000)


@dataclass
class LoopRun:
    tokens: list[int]  # the first max_new tokens, as the gateway streams them (the last cycle may make more)
    decode_s: float  # after the first token
    cycles: int
    draft_ms: float  # engine time of the draft steps (extend + proposal)
    verify_ms: float  # engine time of the verify steps (forward, acceptance, ring write)

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s

    @property
    def accepted_length(self) -> float:
        return (len(self.tokens) - 1) / self.cycles if self.cycles else 0.0


def generate(target: TargetRuntime, draft: DraftRuntime | None, prompt: list[int], max_new: int, steps: int,
             replayer: Replayer | None = None, topk: int = 1, num_draft_tokens: int = 0,
             forced: ForcedAcceptance | None = None, decode: int = 1) -> LoopRun:
    """Greedy; speculation when steps > 0 (then `draft` is required); a tree when topk > 1
    (a replayer turns it into a chain); `forced`: each verify accepts a number drawn from that
    profile (the target must allow it); `decode`: target-only, up to this many tokens a call
    (decoding ahead, a power of two; each counts as a cycle)."""
    sid, spec = next(_ids), steps > 0 and draft is not None
    (first,), _ = target.step([Prefill(sid, prompt, capture=spec)], [])
    if first.code:
        raise RuntimeError(f"prefill failed: {first.message}")
    out, feed, ref, position, release = list(first.tokens), prompt[1:] + first.tokens, first.hidden, 0, []
    cycles, draft_ms, verify_ms = 0, 0.0, 0.0
    rng = random.Random(sid)
    t0 = time.perf_counter()
    while len(out) < max_new:
        drafts: list[int] = []
        parents: list[int] = []
        if spec:
            assert draft is not None and ref is not None
            op = ExtendPropose(sid, feed, ref, steps, position=position, topk=topk, num_draft_tokens=num_draft_tokens)
            (d,), timing = draft.step([op])
            draft_ms += timing.compute_ms
            if replayer:
                drafts = replayer.rewrite(op, d.draft_ids[:steps] if d.draft_parents else d.draft_ids)
            else:
                drafts, parents = d.draft_ids, d.draft_parents
            release.append(ref.generation)  # consumed by the draft
            position += len(feed)
        accept = forced.draw(rng, steps) if forced is not None and drafts else -1
        k = 1 if spec else min(decode, max_new - len(out))
        k = 1 << (k.bit_length() - 1)
        (v,), timing = target.step([Verify(sid, drafts, draft_parents=parents, capture=spec, forced=accept, decode=k)],
                                   release)
        if v.code:
            raise RuntimeError(f"verify failed: {v.message}")
        verify_ms += timing.compute_ms
        release = []
        out += v.tokens
        feed, ref = v.tokens, v.hidden
        cycles += k
    decode_s = time.perf_counter() - t0
    target.step([Release(sid)], [ref.generation] if spec and ref is not None else [])
    if spec and draft is not None:
        draft.step([Release(sid)])
    return LoopRun(out[:max_new], decode_s, cycles, draft_ms, verify_ms)
