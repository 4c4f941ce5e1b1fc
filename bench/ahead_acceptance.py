"""Drafting ahead on the head's own states against waiting for the target's features: how
many of the drafts a pre-draft gets accepted, against the proposal the draft makes at the
same place once the target's features are in (gateway.ahead, draft_service.ahead).

For each prompt the target decodes a greedy reference and captures its features. At every
cycle boundary C of the reference (the target holding C entries) with room behind it, the
draft proposes twice, each with the request's shape:
  - waiting: extended to C with the target's features, then proposing (today's cycle);
  - ahead: extended to C - k - 1 with the target's features, then drafting ahead over the k
    reference tokens after it (a verify that accepted k drafts) and the head's guess of the
    next, proposing from the guess.
Positions where the guess is the reference's token (a hit: only there is a pre-draft used)
count; the accepted drafts of each proposal are read against the reference (a tree: its
deepest node on the reference's path). At every boundary it also makes a cycle's two calls,
each extending k + 1 tokens: the waiting one's proposal there, and a draft-ahead call over that
proposal, which is a hit where it proposed for the verify's outcome against the reference.
Each row gives their median µs (synchronised on CUDA) and the hit rate (`--ahead-slots`: the
draft's scratch slots). One JSON line per shape, then a summary line.

  python -m bench.ahead_acceptance --prompts 6 --max-new-tokens 96                        # CPU, fp32
  python -m bench.ahead_acceptance --num-steps 5 --topk 4 --num-draft-tokens 16 --device cuda:0 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch

from bench.acceptance import chat_prompts
from bench.spec_vs_baseline import git_commit
from draft_service.config import DraftConfig
from gateway.local import LocalEngines
from gateway.scheduler import GenerationRequest
from specsplit.checkpoints.target_checkpoint import resolve_target_dir
from specsplit.ops import DraftResult, ExtendPropose, HiddenRef, Prefill, Release, Sampling
from specsplit.tokenizer import TextCodec
from target_service.config import TargetConfig


def accepted(drafts: list[int], parents: list[int], reference: list[int]) -> int:
    """Drafts the target accepts when `reference` is what it decodes (a chain: leading matches;
    a tree: the depth of its deepest node on the reference's path)."""
    return path_end(drafts, parents, reference)[0]


def path_end(drafts: list[int], parents: list[int], reference: list[int]) -> tuple[int, int]:
    """(drafts accepted, the last accepted one's index: -1 for none) when `reference` is what the
    target decodes."""
    depth, at = 0, -1
    while depth < len(reference):
        nxt = next((i for i in range(len(drafts)) if (parents[i] if parents else i - 1) == at
                    and drafts[i] == reference[depth]), None)
        if nxt is None:
            break
        depth, at = depth + 1, nxt
    return depth, at


def measure(engines: LocalEngines, prompt: list[int], reference: list[int], shape: dict[str, int],
            stride: int) -> tuple[list[tuple[int, int]], list[tuple[float, float, bool]]]:
    """(waiting, ahead) accepted drafts at each hit position of one prompt, and at every position
    the µs of a cycle's waiting call and of a draft-ahead call over its proposal, and whether
    that call proposed for the verify's outcome (a hit)."""
    tokens = prompt + reference
    target, draft = engines.target, engines.draft
    assert draft is not None
    (r,), _ = target.step([Prefill(1, tokens, Sampling(), capture=True)], [])
    feats = r.hidden  # features of every position of prompt + reference
    assert feats is not None
    k, out, times = shape["num_steps"], [], []
    extra = {"topk": shape["topk"], "num_draft_tokens": shape["num_draft_tokens"]}
    sync = torch.cuda.synchronize if draft.engine.device.type == "cuda" else (lambda: None)

    def ref(first: int, end: int) -> HiddenRef:  # the features of positions first..end-1
        return HiddenRef(feats.offset + first, end - first, feats.generation)

    def call(seq: int, end: int, ahead: list[int] | None = None, parents: list[int] | None = None
             ) -> tuple[DraftResult, float]:
        """Sequence `seq` extended to end - k - 1 (untimed), then a call as a cycle makes it: the
        extend of the last k + 1 tokens to `end`, then a proposal, or drafting ahead over `ahead`."""
        mid = end - k - 1
        draft.step([ExtendPropose(seq, tokens[1 : mid + 1], ref(0, mid), k, **extra)])
        sync()
        t0 = time.perf_counter()
        (res,), _ = draft.step([ExtendPropose(seq, tokens[mid + 1 : end + 1], ref(mid, end), k, **extra,
                                              position=mid, ahead=ahead or [], ahead_parents=parents or [])])
        sync()
        return res, (time.perf_counter() - t0) * 1e6

    try:
        for c in range(max(len(prompt) + k + 1, 2 * k + 3), len(tokens) - k - 1, stride):
            start = c - k - 1  # where the ahead's extend stops: k drafts and a bonus before c
            (wait,), _ = draft.step([ExtendPropose(2, tokens[1 : c + 1], ref(0, c), k, **extra)])
            (ahead,), _ = draft.step([ExtendPropose(3, tokens[1 : start + 1], ref(0, start), k, **extra,
                                                    ahead=tokens[start + 1 : start + 1 + k])])
            # a cycle at `start`: its proposal (the waiting call), then a draft-ahead call over it
            proposal, wait_us = call(4, start)
            outcomes, ahead_us = call(5, start, proposal.draft_ids, proposal.draft_parents)
            depth, node = path_end(proposal.draft_ids, proposal.draft_parents, tokens[start + 1 :])
            hit = any(o.node == node and o.bonus == tokens[start + 1 + depth] for o in outcomes.ahead)
            draft.step([Release(2), Release(3), Release(4), Release(5)])
            times.append((wait_us, ahead_us, hit))
            whole = next((o for o in ahead.ahead if o.accepted == k), None)  # the whole path's outcome
            if whole is None or whole.bonus != tokens[c]:
                continue  # a miss: no pre-draft would be used
            truth = tokens[c + 1 : c + 1 + k]
            out.append((accepted(wait.draft_ids, wait.draft_parents, truth),
                        accepted(whole.draft_ids, whole.draft_parents, truth)))
    finally:
        target.step([Release(1)], [feats.generation])
    return out, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--head", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=6, help="held-out chat prompts")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--num-steps", default="3,5", help="comma list")
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int, default=16)
    p.add_argument("--stride", type=int, default=1, help="cycle boundaries measured: every stride-th position")
    p.add_argument("--ahead-slots", type=int, default=DraftConfig.ahead_slots, help="the draft's --ahead-slots")
    a = p.parse_args()
    t0 = time.time()
    codec = TextCodec.from_checkpoint(resolve_target_dir(a.model))
    prompts = [codec.encode(codec.render_chat(t)) for t in chat_prompts(a.prompts)]
    context = max(map(len, prompts)) + a.max_new_tokens + 64
    engines = LocalEngines(TargetConfig(model=a.model, device=a.device, dtype=a.dtype, max_context=context),
                           DraftConfig(head=a.head, target=a.model, device=a.device, dtype=a.dtype,
                                       max_context=context, ahead_slots=a.ahead_slots))
    refs = [r.tokens for r in engines.generate([GenerationRequest(pr, a.max_new_tokens, Sampling(), set(), 0)
                                                for pr in prompts])]
    rows: list[dict[str, Any]] = []
    for steps in [int(x) for x in a.num_steps.split(",") if x]:
        shape = {"num_steps": steps, "topk": a.topk, "num_draft_tokens": a.num_draft_tokens if a.topk > 1 else 0}
        pairs, times = [], []
        for pr, ref in zip(prompts, refs, strict=True):
            got, spent = measure(engines, pr, ref, shape, a.stride)
            pairs += got
            times += spent
        n = max(len(pairs), 1)
        wait_us, ahead_us = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
        row = {"bench": "ahead_acceptance", **shape, "hit_positions": len(pairs),
               "waiting_accepted": round(sum(w for w, _ in pairs) / n, 3),
               "ahead_accepted": round(sum(h for _, h in pairs) / n, 3),
               "same_count": round(sum(w == h for w, h in pairs) / n, 3),
               "waiting_call_us": round(wait_us, 1), "ahead_call_us": round(ahead_us, 1),
               "ahead_call_over_waiting": round(ahead_us / wait_us, 3),
               "hit_rate": round(sum(t[2] for t in times) / max(len(times), 1), 3)}
        row["ahead_over_waiting"] = round(row["ahead_accepted"] / max(row["waiting_accepted"], 1e-9), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    engines.close()
    print(json.dumps({"bench": "ahead_acceptance", "summary": "accepted drafts at hit positions: ahead / waiting",
                      "ratios": {f"steps{r['num_steps']}": r["ahead_over_waiting"] for r in rows},
                      "model": a.model, "head": a.head, "device": a.device, "dtype": a.dtype, "prompts": len(prompts),
                      "max_new_tokens": a.max_new_tokens, "commit": git_commit(), "machine": platform.machine(),
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                      "wall_s": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
