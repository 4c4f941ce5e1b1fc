"""Draft steps chosen per cycle. Greedy requests that do not fix num_steps draft, each cycle,
the plan (chains or trees, and how deep) with the most expected tokens per second for the
batch they share:

    Σ_s E[tokens_s | shape_s] / (draft_ms(deepest) + verify_ms(batch, most rows) + rest_ms)

E comes from each request's own acceptance at each draft depth, measured live and blended with
every request's; the costs from this gateway's own calls, measured live per batch size (a shape
not measured yet is priced by a line through the ones that were). A batch's sequences share a
cycle, so one plan holds for them all: one sequence drafting deep makes every sequence wait for
the deepest draft and the longest verify row. Zero steps is speculation off for that cycle: no
draft call (the extends are put off to the next cycle that drafts, or until 32 tokens wait), the
target verifies one row a sequence (dormant ones several tokens a call: gateway.phases.decode_ahead,
their cost priced a token). Now and then the batch drafts PROBE_EXTRA steps past its
plan (a probe), so that the depths the plan does not reach stay measured: at most every
PROBE_EVERY-th cycle (twice as often while most of the batch is in its first EARLY_CYCLES), and
only while the time probes lose against the best plan stays within PROBE_SHARE of the time
(twice that at first): a probe is charged its expected loss, then, once its cycle ends, what it
measurably lost. The credit holds at most CREDIT_CYCLES cycles' share, so probes never come in
bursts. Where speculation costs several decodes (a small target on a GPU, a large
batch) probes are then rare; where it is cheap they follow the cadence. Sampled requests keep a
fixed shape: their tokens depend on the shape, and a seed must give the same tokens in every
process.

A newcomer starts dormant where the plan its batch would get from what the gateway measured
drafts nothing, and a sequence whose plan drafted nothing DORMANT_AFTER cycles in a row goes
dormant: it lets the draft's state go, so that its cycles cost what speculation off costs (the target captures no
features for it, the draft extends nothing). A probe wakes it: the target recomputes its features
and the draft extends over them, a cost measured live (prefills, whole-prompt extends) that the
probe credit must cover, on top of the probe's own expected loss; its first cycle then drafts
the probe's depth."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.costs import NO_DRAFT, CostModel, DepthAcceptance, Shape

if TYPE_CHECKING:
    from gateway.sequence import GenerationRequest, Sequence

PROBE_EVERY = 8
PROBE_EXTRA = 2
PROBE_SHARE = 0.05  # of the time: what probes may lose against the best plans
CREDIT_CYCLES = 256  # the probe credit holds at most what this many cycles accrue (no bursts of probes)
EARLY_CYCLES = 32  # a request's first cycles probe twice as often: its own acceptance is not known yet
PRIOR_RATE, PRIOR_WEIGHT = 0.5, 2.0  # every request's acceptance before anything is measured
SHARED_DECAY = 0.999  # per observation: the gateway's profile follows the traffic slowly
REQUEST_WEIGHT = 3.0  # pseudo-observations of the gateway's profile behind a request's own
REQUEST_DECAY = 0.9  # per observation: a request's profile follows its text (code, then prose)
REPLAN = 4  # cycles between two plans made for new costs or acceptance observations alone
DORMANT_AFTER = 16  # cycles in a row a sequence's plan drafted nothing before it goes dormant


@dataclass
class Choice:
    shape: Shape
    expected_tokens: float
    expected_ms: float  # nan while the costs are being measured
    reason: str  # "best", "probe" (PROBE_EXTRA past the best) or "measuring" (the request's own shape)

    def attributes(self) -> dict[str, float | int | str | bool]:
        """The cycle span's record of the choice."""
        out: dict[str, float | int | str | bool] = {
            "spec.num_steps": self.shape.steps, "spec.topk": self.shape.topk,
            "spec.num_draft_tokens": self.shape.tokens, "spec.adaptive": True, "spec.adaptive.reason": self.reason,
            "spec.adaptive.expected_tokens": round(self.expected_tokens, 3)}
        if not math.isnan(self.expected_ms):
            out["spec.adaptive.expected_cycle_ms"] = round(self.expected_ms, 3)
            out["spec.adaptive.expected_tokens_per_s"] = round(self.expected_tokens / self.expected_ms * 1e3, 1)
        return out


@dataclass(frozen=True)
class Plan:
    """One cycle's drafting for a batch: `depth` steps for every adaptive sequence, as trees of
    their own branching and size (`trees`, for requests with topk > 1) or as chains; never
    fewer steps than a request's min_steps."""

    depth: int
    trees: bool = False

    def shape(self, req: GenerationRequest) -> Shape:
        if self.trees and req.topk > 1 and self.depth:
            return Shape.tree(self.depth, req.topk, req.num_draft_tokens)
        return Shape.chain(max(self.depth, req.min_steps))


Kind = tuple[int, int, int]  # what a request's shapes depend on: (topk, num_draft_tokens, min_steps)


def _kind(req: GenerationRequest) -> Kind:
    return req.topk, req.num_draft_tokens, req.min_steps


@dataclass
class _Planned:
    """The best plan for one batch, kept until its batch changes or (after a few cycles) the costs
    or the acceptance profiles do."""

    key: tuple[object, ...]  # (batch, floor, sequence ids)
    version: int  # of the costs
    observations: int
    at: int  # the cycle it was made in
    plan: Plan
    ms: float
    tokens: float  # expected, the whole batch
    choices: list[Choice]
    probe: tuple[list[Choice], float] | None = None  # the probe's choices and its expected loss, once priced


@dataclass
class _Probe:
    """A probe in flight: settled with the cycle's measured time once it ends."""

    seqs: list[Sequence]
    generated: int  # tokens the sequences had generated before it
    charged: float  # the loss charged to the credit ahead (expected)
    rate: float  # the best plan's expected tokens a ms


class StepChooser:
    """The gateway's costs and acceptance profiles, and each cycle's choice for the batch.

    The sequences of a batch share a cycle: the draft runs them all to the deepest step, the
    target pads every row to the longest, and every sequence waits for both. So one plan is
    chosen for all adaptive sequences of a cycle, the one with the most expected tokens of the
    whole batch per millisecond of the batch's cycle, and probes are made by the whole batch at
    once. The plan is made again when the batch changes, and after new costs or acceptance
    observations every REPLAN cycles (len(batch) // 4 for large batches: the work grows with it)."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.costs = CostModel()
        self.shared: dict[tuple[int, int], DepthAcceptance] = {}  # (topk, most tokens) -> every request's
        self.observations = 0  # acceptance profiles change with each
        self.cycles = 0  # choices made
        self.probed_at = -1  # the cycle of the last probe
        self.woke_at = -1  # the cycle of the last wake (wakes keep the probes' cadence apart from them)
        self.probe_credit = 0.0  # ms that probes may still lose against the best plans
        self._planned: _Planned | None = None
        self._probe: _Probe | None = None
        self._prices: dict[tuple[object, ...], tuple[int, list[tuple[Plan, float, list[tuple[Kind, tuple[int, int],
                                                                                      int]]]]]] = {}

    @staticmethod
    def _key(req: GenerationRequest, shape: Shape) -> tuple[int, int]:
        return (shape.topk, req.num_draft_tokens) if shape.topk > 1 else (1, 0)

    def plans(self, reqs: list[GenerationRequest]) -> list[Plan]:
        """Chains 0..max_steps deep and, where a request has topk > 1, trees 1..max_steps deep."""
        out = [Plan(d) for d in range(self.max_steps + 1)]
        if any(r.topk > 1 for r in reqs):
            out += [Plan(d, True) for d in range(1, self.max_steps + 1)]
        return out

    def candidates(self, req: GenerationRequest) -> list[Shape]:
        """The shapes a request may draft: its shape under each plan."""
        return list(dict.fromkeys(p.shape(req) for p in self.plans([req])))

    def expected_tokens(self, s: Sequence, shape: Shape) -> float:
        """1 + the expected accepted depth: each depth accepted with the request's rate there,
        given the depths before it were."""
        return self._expected(s, self._key(s.req, shape), shape.steps)[shape.steps]

    def _priors(self, key: tuple[int, int], depth: int) -> list[float]:
        """Every request's acceptance at depths 0..depth of the family `key` (a request's prior)."""
        shared = self.shared.get(key)
        return [shared.rate(i, PRIOR_RATE, PRIOR_WEIGHT) if shared else PRIOR_RATE for i in range(depth + 1)]

    def _expected(self, s: Sequence, key: tuple[int, int], depth: int, priors: list[float] | None = None
                  ) -> list[float]:
        """Expected tokens of drafts 0..depth deep in the family `key`."""
        priors = priors or self._priors(key, depth)
        own = s.acceptance.get(key)
        out, alive = [1.0], 1.0
        for i in range(1, depth + 1):
            alive *= own.rate(i, priors[i], REQUEST_WEIGHT) if own else priors[i]
            out.append(out[-1] + alive)
        return out

    def choose(self, s: Sequence, batch: int) -> Choice:
        """One sequence's choice (a batch of its own adaptive sequence)."""
        return self.choose_batch([s], batch)[0]

    def choose_batch(self, seqs: list[Sequence], batch: int, floor: Shape | None = None) -> list[Choice]:
        """The choice of each adaptive sequence of a cycle of `batch` sequences (all those with
        new tokens), one plan for them all. `floor`: what the cycle drafts for sequences of a
        fixed shape (they make the cycle cost at least that)."""
        self.cycles += 1
        key = (batch, floor, tuple(s.seq_id for s in seqs))
        p = self._planned
        if p is None or p.key != key or ((p.version != self.costs.version or p.observations != self.observations)
                                         and self.cycles - p.at >= max(REPLAN, len(seqs) // 4)):
            p = self._plan(seqs, batch, floor, key)
            if p is None:
                return [Choice(sh, self.expected_tokens(s, sh), math.nan, "measuring")
                        for s in seqs for sh in [Shape.of(s.req)]]
            self._planned = p
        early = 2 * sum(s.stats.cycles < EARLY_CYCLES for s in seqs) > len(seqs)  # most of the batch is new
        self._accrue(PROBE_SHARE * (2 if early else 1), p.ms)
        every = PROBE_EVERY // 2 if early else PROBE_EVERY
        woken = [s for s in seqs if s.wake_probe]  # (the wake paid for the probe's chance: it probes)
        for s in woken:
            s.wake_probe = False
        if (woken or self.cycles - 1 - self.probed_at >= every) and p.plan.depth < self.max_steps:
            if p.probe is None:
                probe = Plan(min(self.max_steps, p.plan.depth + PROBE_EXTRA), p.plan.trees)
                shapes = [probe.shape(s.req) for s in seqs]
                probe_ms = self.costs.cycle_ms(batch, Shape.covering(shapes + ([floor] if floor else []))) or p.ms
                tokens = [self.expected_tokens(s, sh) for s, sh in zip(seqs, shapes, strict=True)]
                p.probe = ([Choice(sh, t, probe_ms, "probe") for sh, t in zip(shapes, tokens, strict=True)],
                           max(0.0, probe_ms - sum(tokens) * p.ms / p.tokens))  # beyond the best's time for as many
            choices, loss = p.probe
            if woken or loss <= self.probe_credit:
                self.probe_credit -= loss
                self.probed_at = self.cycles - 1
                # settled with its measured time, except a woken sequence's: its cycle extends the draft
                # over the whole sequence, a cost its wake was charged already
                self._probe = None if woken else _Probe(list(seqs), sum(len(s.generated) for s in seqs), loss,
                                                        p.tokens / p.ms)
                return choices
        return p.choices

    def _accrue(self, share: float, cycle_ms: float) -> None:
        """A cycle's share of the time to the probe credit, which holds at most CREDIT_CYCLES
        cycles' worth: credit saved over a long stretch without probes (they cost more than it
        held) must not pay for a burst of them later."""
        self.probe_credit = min(self.probe_credit + share * cycle_ms, CREDIT_CYCLES * share * cycle_ms)

    def rests(self, s: Sequence, choice: Choice) -> bool:
        """Count a sequence's cycles whose plan drafted nothing (its probes aside); True once it
        should go dormant: DORMANT_AFTER such cycles with no plan that drafted between them, and
        what waking it costs can be priced."""
        if choice.reason != "probe":
            s.idle_cycles = s.idle_cycles + 1 if not choice.shape.steps and choice.reason == "best" else 0
        return s.idle_cycles >= DORMANT_AFTER and self.costs.resync_ms(max(s.committed, 1)) is not None

    def starts_dormant(self, s: Sequence, batch: int) -> bool:
        """Whether a newcomer starts dormant, its prompt's features not captured: what this gateway
        has measured (the costs at this batch, every request's acceptance as the newcomer's prior)
        makes drafting nothing its best plan, and its wake can be priced. Probes wake it as they
        wake the others."""
        if self.costs.resync_ms(max(len(s.req.prompt_ids), 1)) is None:
            return False
        planned = self._plan([s], batch, None, ("newcomer", batch))
        return planned is not None and not planned.choices[0].shape.steps  # (min_steps > 0 always drafts)

    def wake(self, dormant: list[Sequence], batch: int, planned: bool) -> Sequence | None:
        """The dormant sequence to wake this cycle, if any: the one cheapest to resync, at most one
        every PROBE_EVERY cycles, once the probe credit covers its resync and a probe's expected loss.
        The resync is charged now; the probe when its cycle comes (choose_batch). `planned`:
        choose_batch ran this cycle, else the cycle and its credit are counted here."""
        if not planned:
            self.cycles += 1
        due = self.cycles - 1 - self.woke_at >= PROBE_EVERY
        if planned and not due:  # (most cycles: nothing to price)
            return None
        zero = self.costs.cycle_ms(batch, NO_DRAFT)
        if zero is None:
            return None
        if not planned:
            self._accrue(PROBE_SHARE, zero)
        if not due:
            return None
        s = min(dormant, key=lambda d: d.committed)
        resync = self.costs.resync_ms(max(s.committed, 1))
        probe = self.costs.cycle_ms(batch, Shape.chain(min(PROBE_EXTRA, self.max_steps)))
        if resync is None or probe is None or resync + max(probe - zero, 0.0) > self.probe_credit:
            return None
        self.probe_credit -= resync
        self.woke_at = self.cycles - 1
        s.dormant, s.idle_cycles, s.wake_probe = False, 0, True
        return s

    def record_verify(self, batch: int, rows: int, ms: float) -> None:
        """A verify call's cost (a token a call); a shape the target ran for the first time (its
        graph captured) forgives this cycle's probe."""
        if rows not in self.costs.verify.get(batch, {}):
            self.forgive_probe()
        self.costs.record_verify(batch, rows, ms)

    def forgive_probe(self) -> None:
        """This cycle's calls ran shapes for the first time (their graphs captured, their kernels
        compiled): a probe in it is charged its expected loss only, not that one-time cost."""
        self._probe = None

    def settle(self, cycle_ms: float) -> None:
        """The cycle just ended in `cycle_ms`: if it probed, what it really lost against the best
        plan (its time against the best's for the tokens it emitted) replaces what it was
        expected to lose, so that probes costlier than their estimate are made more rarely."""
        probe, self._probe = self._probe, None
        if probe is not None:
            tokens = sum(len(s.generated) for s in probe.seqs) - probe.generated
            self.probe_credit += probe.charged - max(0.0, cycle_ms - tokens / probe.rate)

    def _plan(self, seqs: list[Sequence], batch: int, floor: Shape | None, key: tuple[object, ...]
              ) -> _Planned | None:
        """The plan with the most expected tokens of the batch a millisecond; None until the
        costs are measured. Sequences of one kind share their shapes: sums by kind."""
        kinds: dict[Kind, GenerationRequest] = {}
        sums: dict[Kind, dict[tuple[int, int], list[float]]] = {}  # kind -> family -> Σ expected tokens by depth
        own: list[dict[tuple[int, int], list[float]]] = []  # each sequence's expected tokens by family and depth
        priors: dict[tuple[int, int], list[float]] = {}
        for s in seqs:
            kind = _kind(s.req)
            kinds.setdefault(kind, s.req)
            families = sums.setdefault(kind, {})
            own.append({})
            for fam in ((1, 0), *([(s.req.topk, s.req.num_draft_tokens)] if s.req.topk > 1 else [])):
                if fam not in priors:
                    priors[fam] = self._priors(fam, self.max_steps)
                e = own[-1][fam] = self._expected(s, fam, self.max_steps, priors[fam])
                total = families.get(fam)
                families[fam] = e.copy() if total is None else [a + b for a, b in zip(total, e, strict=True)]
        priced = self._priced(kinds, batch, floor)
        if priced is None:
            return None
        best: tuple[Plan, float, float] | None = None
        for plan, ms, shapes in priced:  # a tie goes to the fewer steps
            tokens = sum(sums[kind][fam][steps] for kind, fam, steps in shapes)
            if best is None or tokens / ms > best[2] / best[1]:
                best = (plan, ms, tokens)
        assert best is not None
        plan, ms, tokens = best
        choices = [Choice(sh, e[self._key(s.req, sh)][sh.steps], ms, "best")
                   for s, e in zip(seqs, own, strict=True) for sh in [plan.shape(s.req)]]
        return _Planned(key, self.costs.version, self.observations, self.cycles, plan, ms, tokens, choices)

    def _priced(self, kinds: dict[Kind, GenerationRequest], batch: int, floor: Shape | None
                ) -> list[tuple[Plan, float, list[tuple[Kind, tuple[int, int], int]]]] | None:
        """Each plan with its cycle's cost at `batch` and, per kind, the family and depth it
        drafts; None until the costs are measured. Kept until the costs change."""
        key = (batch, floor, tuple(kinds))
        hit = self._prices.get(key)
        if hit is not None and hit[0] == self.costs.version:
            return hit[1]
        out = []
        for plan in self.plans(list(kinds.values())):
            shapes = {kind: plan.shape(req) for kind, req in kinds.items()}
            ms = self.costs.cycle_ms(batch, Shape.covering([*shapes.values(), *([floor] if floor else [])]))
            if ms is None:
                return None
            out.append((plan, max(ms, 1e-6), [(kind, self._key(kinds[kind], sh), sh.steps)
                                              for kind, sh in shapes.items()]))
        if len(self._prices) > 256:
            self._prices.clear()
        self._prices[key] = (self.costs.version, out)
        return out

    def observe(self, s: Sequence, shape: Shape, accepted: int) -> None:
        """A verify of an adaptive request's `shape` accepted `accepted` drafts (a tree: the
        accepted path's depth)."""
        if not shape.steps or not s.req.adaptive:
            return
        self.observations += 1
        key = self._key(s.req, shape)
        shared = self.shared.get(key)
        if shared is None:
            shared = self.shared[key] = DepthAcceptance(self.max_steps, SHARED_DECAY)
        shared.observe(shape.steps, accepted)
        own = s.acceptance.get(key)
        if own is None:
            own = s.acceptance[key] = DepthAcceptance(self.max_steps, REQUEST_DECAY)
        own.observe(shape.steps, accepted)
