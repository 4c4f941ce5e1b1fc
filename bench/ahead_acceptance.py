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
deepest node on the reference's path). One JSON line per shape, then a summary line.

  python -m bench.ahead_acceptance --prompts 6 --max-new-tokens 96                        # CPU, fp32
  python -m bench.ahead_acceptance --num-steps 5 --topk 4 --num-draft-tokens 16 --device cuda:0 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

import torch

from bench.acceptance import chat_prompts
from bench.spec_vs_baseline import git_commit
from draft_service.config import DraftConfig
from gateway.local import LocalEngines
from gateway.scheduler import GenerationRequest
from specsplit.checkpoints.target_checkpoint import resolve_target_dir
from specsplit.ops import ExtendPropose, HiddenRef, Prefill, Release, Sampling
from specsplit.tokenizer import TextCodec
from target_service.config import TargetConfig


def accepted(drafts: list[int], parents: list[int], reference: list[int]) -> int:
    """Drafts the target accepts when `reference` is what it decodes (a chain: leading matches;
    a tree: the depth of its deepest node on the reference's path)."""
    if not parents:
        n = 0
        while n < len(drafts) and n < len(reference) and drafts[n] == reference[n]:
            n += 1
        return n
    depth, at = 0, -1
    while depth < len(reference):
        nxt = next((i for i, p in enumerate(parents) if p == at and drafts[i] == reference[depth]), None)
        if nxt is None:
            break
        depth, at = depth + 1, nxt
    return depth


def measure(engines: LocalEngines, prompt: list[int], reference: list[int], shape: dict[str, int],
            stride: int) -> list[tuple[int, int]]:
    """(waiting, ahead) accepted drafts at each hit position of one prompt."""
    tokens = prompt + reference
    target, draft = engines.target, engines.draft
    assert draft is not None
    (r,), _ = target.step([Prefill(1, tokens, Sampling(), capture=True)], [])
    feats = r.hidden  # features of every position of prompt + reference
    assert feats is not None
    k, out = shape["num_steps"], []
    extra = {"topk": shape["topk"], "num_draft_tokens": shape["num_draft_tokens"]}
    try:
        for c in range(len(prompt) + k + 1, len(tokens) - k - 1, stride):
            start = c - k - 1  # where the ahead's extend stops: k drafts and a bonus before c

            def ref(n: int) -> HiddenRef:
                return HiddenRef(feats.offset, n, feats.generation)

            (wait,), _ = draft.step([ExtendPropose(2, tokens[1 : c + 1], ref(c), k, **extra)])
            (ahead,), _ = draft.step([ExtendPropose(3, tokens[1 : start + 1], ref(start), k, **extra,
                                                    ahead=tokens[start + 1 : start + 1 + k])])
            draft.step([Release(2), Release(3)])
            whole = next((o for o in ahead.ahead if o.accepted == k), None)  # the whole path's outcome
            if whole is None or whole.bonus != tokens[c]:
                continue  # a miss: no pre-draft would be used
            truth = tokens[c + 1 : c + 1 + k]
            out.append((accepted(wait.draft_ids, wait.draft_parents, truth),
                        accepted(whole.draft_ids, whole.draft_parents, truth)))
    finally:
        target.step([Release(1)], [feats.generation])
    return out


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
    a = p.parse_args()
    t0 = time.time()
    codec = TextCodec.from_checkpoint(resolve_target_dir(a.model))
    prompts = [codec.encode(codec.render_chat(t)) for t in chat_prompts(a.prompts)]
    context = max(map(len, prompts)) + a.max_new_tokens + 64
    engines = LocalEngines(TargetConfig(model=a.model, device=a.device, dtype=a.dtype, max_context=context),
                           DraftConfig(head=a.head, target=a.model, device=a.device, dtype=a.dtype,
                                       max_context=context))
    refs = [r.tokens for r in engines.generate([GenerationRequest(pr, a.max_new_tokens, Sampling(), set(), 0)
                                                for pr in prompts])]
    rows: list[dict[str, Any]] = []
    for steps in [int(x) for x in a.num_steps.split(",") if x]:
        shape = {"num_steps": steps, "topk": a.topk, "num_draft_tokens": a.num_draft_tokens if a.topk > 1 else 0}
        pairs = [pair for pr, ref in zip(prompts, refs, strict=True)
                 for pair in measure(engines, pr, ref, shape, a.stride)]
        n = max(len(pairs), 1)
        row = {"bench": "ahead_acceptance", **shape, "hit_positions": len(pairs),
               "waiting_accepted": round(sum(w for w, _ in pairs) / n, 3),
               "ahead_accepted": round(sum(h for _, h in pairs) / n, 3),
               "same_count": round(sum(w == h for w, h in pairs) / n, 3)}
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
