"""Draft steps chosen per cycle. A greedy request that does not fix num_steps drafts, each cycle,
the shape (a chain or a tree, and how deep) with the most expected tokens per second:

    E[tokens | shape] / (draft_ms(shape) + verify_ms(rows) + rest_ms)

E comes from the request's own acceptance at each draft depth, measured live and blended with
every request's; the costs from this gateway's own calls, measured live per batch size (a shape
not measured yet is priced by a line through the ones that were). Zero steps is speculation off
for that cycle: no draft call (its extend is put off to the next cycle that drafts, or until
32 tokens wait), the target verifies one row. Now and then a request drafts PROBE_EXTRA steps past
its choice (a probe), so that the depths its choice does not reach stay measured: at most every
PROBE_EVERY-th cycle (twice as often in its first EARLY_CYCLES), and only while the time probes
lose against its best choice stays within PROBE_SHARE of its time (twice that at first). Where
speculation costs several decodes (a small target on a GPU) probes are then rare; where it is
cheap they follow the cadence. Sampled requests keep a fixed shape: their tokens depend on the
shape, and a seed must give the same tokens in every process."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.sequence import GenerationRequest, Sequence

PROBE_EVERY = 8
PROBE_EXTRA = 2
PROBE_SHARE = 0.05  # of a request's time: what its probes may lose against its best choice
EARLY_CYCLES = 32  # a request's first cycles probe twice as often: its own acceptance is not known yet
PRIOR_RATE, PRIOR_WEIGHT = 0.5, 2.0  # every request's acceptance before anything is measured
SHARED_DECAY = 0.999  # per observation: the gateway's profile follows the traffic slowly
REQUEST_WEIGHT = 3.0  # pseudo-observations of the gateway's profile behind a request's own
REQUEST_DECAY = 0.9  # per observation: a request's profile follows its text (code, then prose)
OUTLIER = 4.0  # a call this many times slower than its shape's estimate is not a cost
REPRICE = 32  # records (three a cycle) between two pricings of the candidates, unless a shape is new


@dataclass(frozen=True)
class Shape:
    """What one cycle drafts: `steps` deep, branching `topk` (1: a chain), `tokens` verified
    counting the root (SGLang's num_draft_tokens; a chain: steps + 1)."""

    steps: int
    topk: int = 1
    tokens: int = 0

    @classmethod
    def chain(cls, steps: int) -> Shape:
        return cls(steps, 1, steps + 1 if steps else 0)

    @classmethod
    def tree(cls, steps: int, topk: int, most_tokens: int) -> Shape:
        """A tree `steps` deep of at most `most_tokens`, cut to what `steps` levels can hold."""
        return cls(steps, topk, min(most_tokens, 1 + topk + (steps - 1) * topk * topk))

    @classmethod
    def of(cls, req: GenerationRequest) -> Shape:
        """The request's own (fixed) shape."""
        if req.topk > 1 and req.num_steps:
            return cls(req.num_steps, req.topk, req.num_draft_tokens)
        return cls.chain(req.num_steps)

    @property
    def rows(self) -> int:
        """Rows the target verifies for one sequence."""
        return self.tokens if self.steps else 1

    @property
    def family(self) -> int:
        return self.topk if self.steps else 1


class DepthAcceptance:
    """How often draft depth i is accepted given depths 1..i-1 were, from decayed counts."""

    def __init__(self, depth: int, decay: float) -> None:
        # counts are kept in units of `scale` (1 / decay per observation) so that an observation
        # touches only the depths it reached; scaled back to 1 before they grow large
        self.trials, self.accepts, self.decay, self.scale = [0.0] * (depth + 1), [0.0] * (depth + 1), decay, 1.0

    def observe(self, steps: int, accepted: int) -> None:
        self.scale /= self.decay
        if self.scale > 1e6:
            self.trials = [t / self.scale for t in self.trials]
            self.accepts = [a / self.scale for a in self.accepts]
            self.scale = 1.0
        for i in range(1, min(accepted + 1, steps, len(self.trials) - 1) + 1):
            self.trials[i] += self.scale
            if i <= accepted:
                self.accepts[i] += self.scale

    def rate(self, i: int, prior: float, weight: float) -> float:
        return (self.accepts[i] + weight * prior * self.scale) / (self.trials[i] + weight * self.scale)


def _line(points: dict[int, float], x: int) -> float:
    """The measured value at x, else a least-squares line through the points (never falling)."""
    if x in points:
        return points[x]
    xs = list(points)
    if len(xs) == 1:
        return points[xs[0]]
    mx, my = sum(xs) / len(xs), sum(points.values()) / len(xs)
    slope = max(sum((a - mx) * (points[a] - my) for a in xs) / sum((a - mx) ** 2 for a in xs), 0.0)
    return max(my + slope * (x - mx), 0.0)


def _nearest(table: dict[int, dict[int, float]], batch: int) -> dict[int, float] | None:
    if not table:
        return None
    return table[min(table, key=lambda b: (abs(b - batch), b))]


@dataclass
class CostModel:
    """Moving averages (ms) of this gateway's calls: draft calls by batch size, branching and
    steps; verify-only target calls by batch size and rows per sequence; the rest of a cycle
    (host work, transport between the calls) by batch size."""

    alpha: float = 0.25
    draft: dict[int, dict[int, dict[int, float]]] = field(default_factory=dict)  # topk -> batch -> steps -> ms
    verify: dict[int, dict[int, float]] = field(default_factory=dict)  # batch -> rows -> ms
    rest: dict[int, float] = field(default_factory=dict)  # batch -> ms
    version: int = 0  # prices computed under another version are stale: a new point, or every REPRICE records
    records: int = 0

    def _avg(self, points: dict[int, float], x: int, ms: float) -> None:
        """Into the moving average at x. A call far slower than that average (a CUDA graph
        captured, a pause) is left out; one far faster replaces it (the first was such a call)."""
        self._count(x not in points)
        if x not in points or ms * OUTLIER < points[x]:
            points[x] = ms
        elif ms <= OUTLIER * points[x]:
            points[x] += self.alpha * (ms - points[x])

    def record_draft(self, batch: int, topk: int, steps: int, ms: float) -> None:
        self._avg(self.draft.setdefault(topk, {}).setdefault(batch, {}), steps, ms)

    def record_verify(self, batch: int, rows: int, ms: float) -> None:
        self._avg(self.verify.setdefault(batch, {}), rows, ms)

    def _count(self, new_point: bool) -> None:
        self.records += 1
        if new_point or self.records % REPRICE == 0:
            self.version += 1

    def record_rest(self, batch: int, ms: float) -> None:
        self._count(batch not in self.rest)
        self.rest[batch] = ms if batch not in self.rest else self.rest[batch] + self.alpha * (ms - self.rest[batch])

    def cycle_ms(self, batch: int, shape: Shape) -> float | None:
        """A cycle of `shape` at `batch`; None until both calls have been measured once."""
        # a branching not measured yet is priced as the chains (or any measured one)
        family = self.draft.get(shape.family) or self.draft.get(1) or next(iter(self.draft.values()), {})
        draft = _nearest(family, batch)
        verify = _nearest(self.verify, batch)
        if draft is None or verify is None:
            return None
        rest = self.rest[min(self.rest, key=lambda b: (abs(b - batch), b))] if self.rest else 0.0
        # nothing drafted: no draft call (the extend is put off, gateway.phases)
        return (_line(draft, shape.steps) if shape.steps else 0.0) + _line(verify, shape.rows) + rest


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


class StepChooser:
    """The gateway's costs and acceptance profiles, and the choice of each adaptive cycle."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.costs = CostModel()
        self.prices: dict[tuple[int, int, int, int], tuple[int, list[tuple[Shape, float]]]] = {}
        self.shared: dict[tuple[int, int], DepthAcceptance] = {}  # (topk, most tokens) -> every request's
        self.observations = 0  # acceptance profiles change with each: a sequence's best choice is then recomputed

    @staticmethod
    def _key(req: GenerationRequest, shape: Shape) -> tuple[int, int]:
        return (shape.topk, req.num_draft_tokens) if shape.topk > 1 else (1, 0)

    def candidates(self, req: GenerationRequest) -> list[Shape]:
        """Speculation off (unless the request turned speculation on), chains 1..max_steps deep,
        and, for a request with topk > 1, its trees 1..max_steps deep up to its size."""
        shapes = [Shape.chain(k) for k in range(req.min_steps, self.max_steps + 1)]
        if req.topk > 1:
            shapes += [Shape.tree(k, req.topk, req.num_draft_tokens) for k in range(1, self.max_steps + 1)]
        return shapes

    def expected_tokens(self, s: Sequence, shape: Shape) -> float:
        """1 + the expected accepted depth: each depth accepted with the request's rate there,
        given the depths before it were."""
        return self._expected(s, self._key(s.req, shape), shape.steps)[shape.steps]

    def _expected(self, s: Sequence, key: tuple[int, int], depth: int) -> list[float]:
        """Expected tokens of drafts 0..depth deep in the family `key`."""
        shared, own = self.shared.get(key), s.acceptance.get(key)
        out, alive = [1.0], 1.0
        for i in range(1, depth + 1):
            prior = shared.rate(i, PRIOR_RATE, PRIOR_WEIGHT) if shared else PRIOR_RATE
            alive *= own.rate(i, prior, REQUEST_WEIGHT) if own else prior
            out.append(out[-1] + alive)
        return out

    def _priced(self, req: GenerationRequest, batch: int) -> list[tuple[Shape, float]] | None:
        """The candidates of requests like `req` with their cycle's cost at `batch`, priced again
        when a shape is measured for the first time and every REPRICE records (about ten cycles)."""
        key = (batch, req.min_steps, req.topk, req.num_draft_tokens)
        hit = self.prices.get(key)
        if hit is not None and hit[0] == self.costs.version:
            return hit[1]
        priced = []
        for shape in self.candidates(req):
            ms = self.costs.cycle_ms(batch, shape)
            if ms is None:
                return None
            priced.append((shape, max(ms, 1e-6)))
        self.prices[key] = (self.costs.version, priced)
        return priced

    def choose(self, s: Sequence, batch: int) -> Choice:
        priced = self._priced(s.req, batch)
        if priced is None:
            own = Shape.of(s.req)
            return Choice(own, self.expected_tokens(s, own), math.nan, "measuring")
        state = (self.costs.version, self.observations, batch)  # what the best choice depends on
        if s.best is None or s.best[0] != state:
            s.best = (state, self._best(s, priced))
        best, best_ms, best_tokens = s.best[1]
        best_rate = best_tokens / best_ms
        early = s.stats.cycles < EARLY_CYCLES
        s.probe_credit += PROBE_SHARE * (2 if early else 1) * best_ms
        every = PROBE_EVERY // 2 if early else PROBE_EVERY
        if s.stats.cycles - s.probed_at >= every and best.steps < self.max_steps:
            steps = min(self.max_steps, best.steps + PROBE_EXTRA)
            probe = Shape.tree(steps, best.topk, s.req.num_draft_tokens) if best.topk > 1 else Shape.chain(steps)
            probe_ms, probe_tokens = self.costs.cycle_ms(batch, probe) or best_ms, self.expected_tokens(s, probe)
            loss = max(0.0, probe_ms - probe_tokens / best_rate)  # beyond the best's time for as many tokens
            if loss <= s.probe_credit:
                s.probe_credit -= loss
                s.probed_at = s.stats.cycles
                return Choice(probe, probe_tokens, probe_ms, "probe")
        return Choice(best, best_tokens, best_ms, "best")

    def _best(self, s: Sequence, priced: list[tuple[Shape, float]]) -> tuple[Shape, float, float]:
        """The candidate with the most expected tokens a millisecond: (shape, ms, expected tokens)."""
        expected = {key: self._expected(s, key, self.max_steps) for key in {self._key(s.req, sh) for sh, _ in priced}}
        best, best_ms, best_tokens, best_rate = priced[0][0], priced[0][1], 1.0, -1.0
        for shape, ms in priced:  # a tie goes to the fewer steps
            tokens = expected[self._key(s.req, shape)][shape.steps]
            if tokens / ms > best_rate:
                best, best_ms, best_tokens, best_rate = shape, ms, tokens, tokens / ms
        return best, best_ms, best_tokens

    def observe(self, s: Sequence, shape: Shape, accepted: int) -> None:
        """A verify of an adaptive request's `shape` accepted `accepted` drafts (a tree: the
        accepted path's depth)."""
        if not shape.steps or not s.req.adaptive:
            return
        self.observations += 1
        key = self._key(s.req, shape)
        self.shared.setdefault(key, DepthAcceptance(self.max_steps, SHARED_DECAY)).observe(shape.steps, accepted)
        own = s.acceptance.setdefault(key, DepthAcceptance(self.max_steps, REQUEST_DECAY))
        own.observe(shape.steps, accepted)
