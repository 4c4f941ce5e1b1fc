"""What the per-cycle choice of draft steps (gateway.adaptive) works from: the shape a cycle
drafts, how often each draft depth is accepted, and what this gateway's calls cost, measured
live."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.sequence import GenerationRequest

OUTLIER = 4.0  # a call this many times slower than its shape's estimate is not a cost
REPRICE = 96  # records (three a cycle) between two pricings of the candidates, unless a shape is new


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

    @classmethod
    def covering(cls, shapes: list[Shape]) -> Shape:
        """What a batched cycle of these shapes costs like: its deepest draft, widest branching and
        most rows (the draft runs every sequence to the deepest step, the verify pads rows to the most)."""
        steps = max(sh.steps for sh in shapes)
        if not steps:
            return cls.chain(0)
        return cls(steps, max(sh.family for sh in shapes), max(sh.rows for sh in shapes))

    @property
    def rows(self) -> int:
        """Rows the target verifies for one sequence."""
        return self.tokens if self.steps else 1

    @property
    def family(self) -> int:
        return self.topk if self.steps else 1


NO_DRAFT = Shape.chain(0)  # a cycle that drafts nothing


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


def _bucket(tokens: int) -> int:
    """Token counts in powers of two: a few points for the line, whatever the prompts' lengths."""
    return 1 << max(tokens - 1, 0).bit_length()


def _at_least(points: dict[int, float], x: int) -> float:
    """What x tokens cost at most, for a cost that grows with tokens: the cheapest measured point
    at x or above, else the line through the points (_line) but no less than the largest one."""
    above = [ms for at, ms in points.items() if at >= x]
    if above:
        return min(above)
    return max(_line(points, x), points[max(points)])


def _nearest(table: dict[int, dict[int, float]], batch: int) -> dict[int, float] | None:
    if not table:
        return None
    return table[min(table, key=lambda b: (abs(b - batch), b))]


@dataclass
class CostModel:
    """Moving averages (ms) of this gateway's calls: draft calls by batch size, branching and
    steps; verify-only target calls by batch size and rows per sequence, those that decode a token
    a call (a verify's rows are one call's); calls that decode several tokens a sequence (decoding
    ahead) by batch size, a token's share of the call; the rest of a cycle
    (host work, transport between the calls) by batch size, for cycles with a draft call and
    for cycles without one (a cycle that drafts nothing makes one call)."""

    alpha: float = 0.25
    draft: dict[int, dict[int, dict[int, float]]] = field(default_factory=dict)  # topk -> batch -> steps -> ms
    verify: dict[int, dict[int, float]] = field(default_factory=dict)  # batch -> rows -> ms, a token a call
    decode: dict[int, float] = field(default_factory=dict)  # batch -> ms a token, calls that decode several
    rest: dict[int, float] = field(default_factory=dict)  # batch -> ms, cycles with a draft call
    rest_alone: dict[int, float] = field(default_factory=dict)  # batch -> ms, cycles with the target's call alone
    prefill: dict[int, float] = field(default_factory=dict)  # tokens -> ms, target calls that prefill or recapture
    extend: dict[int, float] = field(default_factory=dict)  # tokens -> ms, draft calls that extend a whole prompt
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

    def record_decode(self, batch: int, ms: float) -> None:
        """A call that decoded several tokens for each of `batch` sequences: `ms` a token."""
        self._avg(self.decode, batch, ms)

    def record_prefill(self, tokens: int, ms: float) -> None:
        """A target call that prefilled (or recomputed the features of) `tokens` tokens in all."""
        self._avg(self.prefill, _bucket(tokens), ms)

    def record_extend(self, tokens: int, ms: float) -> None:
        """A draft call whose longest extend held `tokens` tokens (a newcomer's prompt, a resync)."""
        self._avg(self.extend, _bucket(tokens), ms)

    def resync_ms(self, tokens: int) -> float | None:
        """Waking a sequence of `tokens` tokens whose draft state was let go: the target recomputes
        its features, the draft extends over all of them; None until a prefill was measured (an
        extend not measured yet is priced as the prefill). Priced from above (_at_least): a wake
        is paid for with speculation's time, so it must not be priced low."""
        if not self.prefill:
            return None
        target = _at_least(self.prefill, tokens)
        return target + (_at_least(self.extend, tokens) if self.extend else target)

    def _count(self, new_point: bool) -> None:
        self.records += 1
        if new_point or self.records % REPRICE == 0:
            self.version += 1

    def record_rest(self, batch: int, ms: float, drafted: bool = True) -> None:
        """What a cycle spent outside its calls; `drafted`: it made a draft call (two calls'
        transport and the draft's bookkeeping), else the target's call alone."""
        table = self.rest if drafted else self.rest_alone
        self._count(batch not in table)
        table[batch] = ms if batch not in table else table[batch] + self.alpha * (ms - table[batch])

    def _decode_ms(self, batch: int) -> float | None:
        """Decoding ahead's ms a token at the nearest batch measured, if any."""
        return self.decode[min(self.decode, key=lambda b: (abs(b - batch), b))] if self.decode else None

    def token_ms(self, batch: int) -> float | None:
        """A target call's ms a token when nothing is drafted, at the nearest batch measured:
        decoding ahead's where it was measured, else a call of one token."""
        ahead = self._decode_ms(batch)
        if ahead is not None:
            return ahead
        verify = _nearest(self.verify, batch)
        return verify.get(1) if verify else None

    def verify_ms(self, batch: int, rows: int) -> float | None:
        """A verify call of `rows` rows a sequence at the nearest batch measured. Where that batch
        has one row count measured only (speculation off there), the rows' growth is the nearest
        batch's that has several: a verify of many rows is never priced as a decode."""
        table = _nearest(self.verify, batch)
        if table is None:
            return None
        if rows in table or len(table) > 1:
            return _line(table, rows)
        (at, ms), = table.items()
        wider = {b: t for b, t in self.verify.items() if len(t) > 1}
        other = _nearest(wider, batch)
        return ms + (max(_line(other, rows) - _line(other, at), 0.0) if other else 0.0)

    def cycle_ms(self, batch: int, shape: Shape) -> float | None:
        """A cycle of `shape` at `batch`; None until both calls have been measured once."""
        # a branching not measured yet is priced as the chains (or any measured one)
        family = self.draft.get(shape.family) or self.draft.get(1) or next(iter(self.draft.values()), {})
        draft = _nearest(family, batch)
        ahead = None if shape.steps else self._decode_ms(batch)
        verify = ahead if ahead is not None else self.verify_ms(batch, shape.rows)
        if draft is None or verify is None:
            return None
        table = self.rest_alone if not shape.steps and self.rest_alone else self.rest
        rest = table[min(table, key=lambda b: (abs(b - batch), b))] if table else 0.0
        # nothing drafted: no draft call (the extend is put off, gateway.phases), a token's share
        # of a call that decodes ahead where that was measured
        return (_line(draft, shape.steps) if shape.steps else 0.0) + verify + rest
