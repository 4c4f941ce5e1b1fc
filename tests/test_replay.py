"""The benchmark-only replay drafter: acceptance chosen per (reference, position), so runs with
different histories (warm-ups, other sequences) replay the same acceptance."""

from __future__ import annotations

import statistics

from bench.replay import Replayer
from specsplit.ops import ExtendPropose, HiddenRef

REFS = [list(range(1, 4001)), list(range(5001, 9001))]


def replay(r: Replayer, seq_id: int, ref: list[int], steps: int, tokens: int) -> list[int]:
    """A target that accepts drafts equal to the reference: the accepted length of each cycle."""
    seen, position, lengths = 9, 0, []
    out = r.rewrite(ExtendPropose(seq_id, ref[1:10], HiddenRef(0, 9, 0), steps, position=0), [0] * steps)
    while seen < tokens:
        a = 0
        while a < steps and out[a] == ref[seen + 1 + a]:
            a += 1
        lengths.append(a + 1)
        feed = ref[seen + 1 : seen + 2 + a]
        position, seen = position + len(feed), seen + a + 1
        out = r.rewrite(ExtendPropose(seq_id, feed, HiddenRef(0, len(feed), 0), steps, position=position),
                        [0] * steps)
    return lengths


def test_replayed_acceptance_does_not_depend_on_what_ran_before() -> None:
    fresh = Replayer(REFS, 0.8, 10_000)
    used = Replayer(REFS, 0.8, 10_000)
    replay(used, 1, REFS[0], 3, 500)  # a warm-up on the same reference with another num_steps
    replay(used, 2, REFS[1], 5, 500)
    assert replay(fresh, 3, REFS[0], 5, 2000) == replay(used, 4, REFS[0], 5, 2000)


def test_replayed_acceptance_has_the_chosen_rate() -> None:
    lengths = replay(Replayer(REFS, 0.8, 10_000, seed=3), 1, REFS[0], 5, 3900)
    expected = sum(0.8**i for i in range(6))  # 1 + p + ... + p^5: geometric, cut at 5 drafts
    assert abs(statistics.mean(lengths) - expected) < 4 * statistics.stdev(lengths) / len(lengths) ** 0.5
