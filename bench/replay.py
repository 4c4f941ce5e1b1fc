"""Replay drafter (benchmarks and tests only): runs the real draft for its cost and its
state, then replaces its proposals with the target's own reference continuation, with
mistakes injected at a chosen per-token acceptance rate. Output from it must say
"replayed acceptance": the acceptance is chosen, not earned."""

from __future__ import annotations

import json
import random
from pathlib import Path

from gateway.clients import DraftClient, Meanwhile
from specsplit.ops import Code, DraftOp, DraftResult, ExtendPropose, StepTiming

LABEL = "replayed acceptance"


class Replayer:
    """Rewrites proposals. A sequence is matched to its reference (prompt + target-only greedy
    output) by its first extend, which carries tokens 1..n of the sequence.

    Whether the draft "guesses" the reference token at a position is a seeded function of
    (reference, position) alone, not of a stream shared by everything the replayer has seen:
    two runs of the same references (one in process, one through the services, with
    different warm-ups before them) get the same acceptance, cycle for cycle. A position
    drafted again after an earlier rejection reuses its draw; that draw had no effect before
    (acceptance stops at the first miss), so positions stay independent Bernoulli(rate)."""

    def __init__(self, references: list[list[int]], accept_rate: float, vocab: int, seed: int = 0) -> None:
        if not 0.0 <= accept_rate <= 1.0:
            raise ValueError(f"accept rate {accept_rate} outside [0, 1]")
        self.references, self.accept_rate, self.vocab, self.seed = references, accept_rate, vocab, seed
        self.hits: dict[int, list[bool]] = {}  # reference index -> whether the draft guesses each position
        self.by_seq: dict[int, tuple[int, int]] = {}  # seq_id -> (reference index, tokens consumed so far)

    @classmethod
    def from_file(cls, path: str | Path, accept_rate: float, vocab: int) -> Replayer:
        refs = json.loads(Path(path).read_text())
        if not isinstance(refs, list) or not all(isinstance(r, list) for r in refs):
            raise ValueError(f"{path}: expected a JSON list of token-id lists")
        return cls([[int(t) for t in r] for r in refs], accept_rate, vocab)

    def _hit(self, index: int, position: int, stream: int = 0) -> bool:
        key = index + stream * len(self.references)  # stream 1: guesses that depart from a drafted path
        if key not in self.hits:
            rng = random.Random(self.seed * 1_000_003 + key)
            self.hits[key] = [rng.random() < self.accept_rate for _ in self.references[index]]
        hits = self.hits[key]
        return position < len(hits) and hits[position]

    def rewrite(self, op: ExtendPropose, draft_ids: list[int], outcomes: list[tuple[int, list[int]]] | None = None
                ) -> list[int]:
        """An extend-and-propose's drafts as replayed. Drafting ahead (op.ahead), `outcomes`
        (accepted path tokens, guessed token then drafts) are rewritten in place, each from the
        position after its accepted tokens; an outcome that departs from the path guesses right
        at the same rate, by a draw of its own."""
        if op.position == 0:
            index = next((i for i, r in enumerate(self.references) if r[1 : 1 + len(op.tokens)] == op.tokens), None)
            if index is None:
                self.by_seq.pop(op.seq_id, None)
                return draft_ids
            self.by_seq[op.seq_id] = (index, 0)
        if op.seq_id not in self.by_seq:
            return draft_ids
        index, seen = self.by_seq[op.seq_id]
        n = seen + len(op.tokens)  # the draft has seen tokens 1..n; the next true token is ref[n + 1]
        self.by_seq[op.seq_id] = (index, n)
        for accepted, ids in outcomes or []:
            departs = accepted < len(op.ahead)  # (the path's own draw at that position said: rejected)
            ids[:] = self._replayed(index, n + 1 + accepted, len(ids), departs)
        return self._replayed(index, n + 1, len(draft_ids))

    def _replayed(self, index: int, start: int, count: int, departs: bool = False) -> list[int]:
        ref, out = self.references[index], []
        for at in range(start, start + count):
            true = ref[at] if at < len(ref) else 0
            hit = self._hit(index, at, 1) if departs and at == start else self._hit(index, at)
            out.append(true if hit else (true + 1) % self.vocab)
        return out

    def forget(self, seq_id: int) -> None:
        self.by_seq.pop(seq_id, None)


class ReplayDraft:
    """A draft client whose proposals are rewritten by a Replayer."""

    def __init__(self, inner: DraftClient, replayer: Replayer) -> None:
        self.inner, self.replayer = inner, replayer

    async def step(self, ops: list[DraftOp], timeout: float = 0.0, meanwhile: Meanwhile = None
                   ) -> tuple[list[DraftResult], StepTiming]:
        results, timing = await self.inner.step(ops, timeout, meanwhile)
        self._rewrite(ops, results)
        return results, timing

    async def send(self, ops: list[DraftOp]) -> tuple[list[DraftOp], object]:
        return ops, await self.inner.send(ops)  # type: ignore[attr-defined]

    async def receive(self, sent: tuple[list[DraftOp], object], timeout: float
                      ) -> tuple[list[DraftResult], StepTiming]:
        results, timing = await self.inner.receive(sent[1], timeout)  # type: ignore[attr-defined]
        self._rewrite(sent[0], results)
        return results, timing

    def _rewrite(self, ops: list[DraftOp], results: list[DraftResult]) -> None:
        by_op = {op.seq_id: op for op in ops if isinstance(op, ExtendPropose)}
        for r in results:
            op = by_op.get(r.seq_id)
            if op is None:
                self.replayer.forget(r.seq_id)
                continue
            if r.code != Code.OK:  # nothing extended
                continue
            # a tree is replaced by a chain as deep as the tree; drafting ahead, each outcome's guess is replayed too
            outcomes = [(o.accepted, [o.bonus, *(o.draft_ids[: op.num_steps] if o.draft_parents else o.draft_ids)])
                        for o in r.ahead]
            ids = self.replayer.rewrite(op, r.draft_ids[: op.num_steps] if r.draft_parents else r.draft_ids, outcomes)
            if r.draft_ids:
                r.draft_ids, r.draft_parents = ids, []
            for o, (_, replayed) in zip(r.ahead, outcomes, strict=True):
                o.bonus, o.draft_ids, o.draft_parents = replayed[0], replayed[1:], []

    def __getattr__(self, name: str) -> object:  # stream, attach, close: the inner client's
        return getattr(self.inner, name)
