"""Forced acceptance, a benchmark mode for shapes without trained weights: a random head
accepts nothing, so how fast a trained one would make a model cannot be measured with it.
With --benchmark-forced-acceptance the gateway draws how many drafts each verify accepts from
a per-depth acceptance profile and the target (started with the flag of the same name) accepts
that many whatever its logits say. The target still verifies every draft and commits the
accepted rows: the cycle costs what a real one costs. The output is not the model's; every
benchmark line that uses the mode says "forced acceptance".

A random head's scores are flat, so its trees are wide and shallow (of topk 4 and 16 tokens,
the 4 nodes of depth 1 and 11 of depth 2), and forced acceptance, which goes down the deepest
path, cannot go as deep as the profile: a trained head's trees follow its likely chain. With
--benchmark-tree-profile the draft ranks its tree's candidates by the profile instead of the
head's probabilities (`rank_log_probs`): at each depth the best child scores the profile's
rate there and its siblings share the rest, so the tree keeps a chain as deep as its steps
with siblings along it, as a trained head's does. The draft still runs every level and every
node; only which candidates it keeps changes."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# The shipped SmolLM2 head's acceptance at depths 1..5 given the depths before it were accepted:
# trees of topk 4 and 16 tokens, 5 steps, HumanEval and held-out chat prompts, bf16 on an H200
# (bench/results/acceptance_h200_d02cb94_tree_k4n16_steps5-3.jsonl); deeper depths repeat the last.
SHIPPED_PROFILE = (0.833, 0.784, 0.734, 0.714, 0.721)
RANK_FLOOR = 1e-4  # a rank's probability at least (rates of 0 or 1 leave no -inf scores)


@dataclass(frozen=True)
class ForcedAcceptance:
    rates: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> ForcedAcceptance | None:
        """'' (off), 'shipped', or comma-separated rates in [0, 1] of depths 1, 2, ..."""
        if not text:
            return None
        if text == "shipped":
            return cls(SHIPPED_PROFILE)
        try:
            rates = tuple(float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"forced acceptance {text!r}: 'shipped' or comma-separated rates") from None
        if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"forced acceptance {text!r}: every rate must be within [0, 1]")
        return cls(rates)

    def rate(self, depth: int) -> float:
        return self.rates[min(depth, len(self.rates)) - 1]

    def draw(self, rng: random.Random, steps: int) -> int:
        """How many of `steps` drafts (a tree: levels) the next verify accepts."""
        accepted = 0
        while accepted < steps and rng.random() < self.rate(accepted + 1):
            accepted += 1
        return accepted

    def rank_log_probs(self, depths: int, topk: int) -> list[list[float]]:
        """[depths][topk] the log-probabilities the draft ranks a tree's candidates by (its
        --benchmark-tree-profile): at depth d the best child the rate of d, the others 1 - that
        rate in halves (1/2, 1/4, ... of it, the last two equal), each at least RANK_FLOOR."""
        out = []
        for d in range(1, depths + 1):
            rest = 1.0 - self.rate(d)
            shares = [0.5 ** (i + 1) for i in range(topk - 1)]
            if shares:
                shares[-1] *= 2  # (halves that sum to one)
            out.append([math.log(max(p, RANK_FLOOR)) for p in [self.rate(d), *(rest * s for s in shares)]])
        return out

    @property
    def label(self) -> str:
        return "forced acceptance " + ",".join(f"{r:g}" for r in self.rates)

    def label_for(self, trees: bool) -> str:
        """A benchmark line's label: the profile, and that trees were ranked by it (the draft's
        --benchmark-tree-profile) where the run drafts trees."""
        return self.label + (", trees ranked by it" if trees else "")
