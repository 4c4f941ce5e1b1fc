"""A step's packed integers (specsplit.runner.packing.pack_rows) against each row's fields stated
one row at a time: tokens, positions, entries, slots, masks, the acceptance's parent and expect
(specsplit.runner.acceptance.row_fields) and the ring's writes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specsplit.models.batch import tree_ancestry
from specsplit.runner.acceptance import row_fields
from specsplit.runner.packing import Row, pack_rows


def random_tree(rng: random.Random, n: int) -> tuple[int, ...]:
    """A verify row's parents: the root, then each node under an earlier one."""
    return (-1, *(rng.randrange(j) for j in range(1, n)))


def random_row(rng: random.Random, t: int, ring_row: int) -> Row:
    n = rng.randint(0, t) if rng.random() < 0.2 else rng.randint(1, t)
    tokens = [rng.randrange(6) for _ in range(n)]  # few distinct tokens: twins are common
    parents = random_tree(rng, n) if n and rng.random() < 0.6 else None
    accept = n > 0 and rng.random() < 0.8  # an empty row is a batch's padding
    forced = rng.choice([-1, -1, -1, 0, 2, 5]) if accept else -1
    return Row(rng.randrange(64), rng.randrange(500), tokens, parents, accept,
               ring_row if rng.random() < 0.7 else -1, forced)


def expected(rows: list[Row], t: int, tree: bool, verify: bool, ring: bool) -> dict[str, np.ndarray]:
    """The fields, each row's on its own."""
    out: dict[str, list[list[int]]] = {k: [] for k in ("tokens", "positions", "entries", "mask", "parent", "expect")}
    for row in rows:
        n = len(row.tokens)
        out["tokens"].append([*row.tokens, *[0] * (t - n)])
        entries = list(range(row.start, row.start + t))
        out["entries"].append(entries)
        mask = np.tril(np.ones((t, t), dtype=np.int64))
        positions = entries
        if tree and row.parents:
            m, depth = tree_ancestry(tuple(row.parents), t)
            mask[:n] = m
            positions = [row.start + d for d in [*depth, *range(n, t)]]
        out["positions"].append(positions)
        out["mask"].append(mask.tolist())
        parent, expect = row_fields(row.tokens, row.parents, row.accept, t, row.forced)
        out["parent"].append(parent)
        out["expect"].append(expect)
    fields = {k: np.array(v, dtype=np.int64) for k, v in out.items()}
    fields["slots"] = np.array([row.slot for row in rows], dtype=np.int64)
    if ring:
        dst = [row.ring_row + j for row in rows if row.ring_row >= 0 for j in range(len(row.tokens))]
        src = [i * t + j for i, row in enumerate(rows) if row.ring_row >= 0 for j in range(len(row.tokens))]
        fill = len(rows) * t - len(dst)
        fields["ring_dst"] = np.array(dst + [dst[0]] * fill)
        fields["ring_src"] = np.array(src + [src[0]] * fill)
    return fields


@pytest.mark.parametrize("seed", range(40))
def test_a_packed_step_holds_each_rows_fields(seed: int) -> None:
    rng = random.Random(seed)
    b, t = rng.randint(1, 9), rng.choice([1, 2, 5, 16])
    tree, verify, ring = rng.random() < 0.7, rng.random() < 0.8, rng.random() < 0.5
    rows = [random_row(rng, t, 100 * i) for i in range(b)]
    if ring and all(row.ring_row < 0 or not row.tokens for row in rows):
        rows[0] = Row(rows[0].slot, rows[0].start, [1, *rows[0].tokens][:t], None, True, 7)
    tree = tree or any(row.parents for row in rows)  # as the runner packs a step with a tree in it
    packed, layout = pack_rows(rows, b, t, tree, verify, ring)
    assert packed.dtype == np.int64
    got = layout.unpack(torch.from_numpy(packed))
    want = expected(rows, t, tree, verify, ring)
    for name in ("tokens", "positions", "entries", "slots"):
        np.testing.assert_array_equal(got[name].numpy(), want[name], err_msg=name)
    if tree:
        np.testing.assert_array_equal(got["mask"].numpy(), want["mask"])
    if verify:
        np.testing.assert_array_equal(got["fields"][:, 0].numpy(), want["parent"])
        np.testing.assert_array_equal(got["fields"][:, 1].numpy(), want["expect"])
    if ring:
        np.testing.assert_array_equal(got["ring_dst"].numpy(), want["ring_dst"])
        np.testing.assert_array_equal(got["ring_src"].numpy(), want["ring_src"])
    assert packed.size == sum(int(np.prod(s)) for s in layout.shapes().values())
