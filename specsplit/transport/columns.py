"""A step's many sequences, column by column (target.proto: VerifyColumns, ResultColumns;
draft.proto: ExtendProposeColumns, DraftResultColumns): a few calls encode or decode the ops
and results of any number of sequences, against a dozen per sequence as messages of their own
(specsplit.transport.wire, which still carries what columns do not: draft distributions,
inline rows, failures, drafting ahead, the other ops). The readers raise ValueError when columns do not line
up."""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import Any, TypeVar

from specsplit.ops import Code, DraftOp, DraftResult, ExtendPropose, HiddenRef, Sampling, TargetOp, TargetResult, Verify
from specsplit.transport.step_stream import StepCodec
from specsplit.transport.wire import (
    draft_op_from_proto,
    draft_result_from_proto,
    target_op_from_proto,
    target_result_from_proto,
    write_draft_op,
    write_draft_result,
    write_target_op,
    write_target_result,
)
from specsplit.v1 import draft_pb2, target_pb2

T = TypeVar("T")


# sequences a step: fewer cost less as messages of their own (each column costs a few calls)
COLUMNS_FROM = 5
DRAFT_COLUMNS_FROM = 8  # an extend-and-propose has twice a verify's columns


def write_target_step(m: target_pb2.TargetStepRequest, ops: list[TargetOp]) -> None:
    """A step's ops into m: verifies without draft distributions as columns where there are
    COLUMNS_FROM of them, the others one message each."""
    columns, rest = _sort_out(ops, lambda op: type(op) is Verify and not op.draft_dists,  # type: ignore[union-attr]
                              COLUMNS_FROM)
    for op in rest:
        write_target_op(m.ops.add(), op)
    if not columns:
        return
    c = m.verifies
    c.seq_ids.extend([op.seq_id for op in columns])
    c.capture_hidden.extend([op.capture for op in columns])
    _write_drafts(c, [op.draft_ids for op in columns], [op.draft_parents for op in columns])
    if any(op.forced >= 0 for op in columns):
        c.forced_accept.extend([op.forced for op in columns])
    if any(op.decode != 1 for op in columns):
        c.decode_tokens.extend([op.decode for op in columns])
    if any(op.trace for op in columns):
        c.traceparents.extend([op.trace for op in columns])


def target_step_verifies(m: target_pb2.TargetStepRequest) -> list[Verify]:
    """The verifies a request sends as columns; ValueError when they do not line up."""
    if not m.HasField("verifies"):
        return []
    c = m.verifies
    seq_ids = list(c.seq_ids)
    n = len(seq_ids)
    if not n:
        return []
    capture = _column(n, "capture_hidden", list(c.capture_hidden))
    forced = _column(n, "forced_accept", list(c.forced_accept), -1)
    traces = _column(n, "traceparents", list(c.traceparents), "")
    decode = _column(n, "decode_tokens", list(c.decode_tokens), 1)
    ids, parents = _read_drafts(c, n)
    return [Verify(seq_ids[i], ids[i], [], parents[i], capture[i], traces[i], forced[i], decode[i]) for i in range(n)]


def write_target_results(m: target_pb2.TargetStepResponse, results: list[TargetResult]) -> None:
    """A step's results into m: successful ones without inline rows as columns where there are
    COLUMNS_FROM of them, the others one message each."""
    ok, rest = _sort_out(results, lambda r: r.code == Code.OK and (r.hidden is None or not r.hidden.inline),
                         COLUMNS_FROM)
    for r in rest:
        write_target_result(m.results.add(), r)
    if not ok:
        return
    c = m.ok
    c.seq_ids.extend([r.seq_id for r in ok])
    c.token_counts.extend([len(r.tokens) for r in ok])
    c.tokens.extend([t for r in ok for t in r.tokens])
    c.num_accepted.extend([r.num_accepted for r in ok])
    c.hidden_rows.extend([0 if r.hidden is None else r.hidden.rows for r in ok])
    c.hidden_offsets.extend([0 if r.hidden is None else r.hidden.offset for r in ok])
    c.hidden_generations.extend([0 if r.hidden is None else r.hidden.generation for r in ok])


def target_results_from_proto(m: target_pb2.TargetStepResponse) -> list[TargetResult]:
    """Every result of a step's response; ValueError when its columns do not line up."""
    out = [target_result_from_proto(p) for p in m.results]
    if not m.HasField("ok"):
        return out
    c = m.ok
    seq_ids = list(c.seq_ids)
    n = len(seq_ids)
    if not n:
        return out
    cols = [_column(n, name, list(getattr(c, name)))
            for name in ("token_counts", "num_accepted", "hidden_rows", "hidden_offsets", "hidden_generations")]
    counts, accepted, rows, offsets, generations = cols
    tokens = _split(list(c.tokens), counts, "tokens")
    return out + [TargetResult(seq_ids[i], tokens=tokens[i], num_accepted=accepted[i],
                               hidden=HiddenRef(offsets[i], rows[i], generations[i]) if rows[i] else None)
                  for i in range(n)]


# -- draft
def _columned(op: DraftOp) -> bool:
    return (type(op) is ExtendPropose and not op.hidden.inline and not op.ahead  # type: ignore[union-attr]
            and (not op.earlier or not any(r.inline for r in op.earlier)))  # type: ignore[union-attr]


def write_draft_step(m: draft_pb2.DraftStepRequest, ops: list[DraftOp]) -> None:
    """A step's ops into m: extend-and-proposes without inline rows as columns where there are
    DRAFT_COLUMNS_FROM of them, the others one message each."""
    columns: list[ExtendPropose]
    columns, rest = _sort_out(ops, _columned, DRAFT_COLUMNS_FROM)  # type: ignore[assignment]
    for op in rest:
        write_draft_op(m.ops.add(), op)
    if not columns:
        return
    c = m.extend_proposes
    c.seq_ids.extend([op.seq_id for op in columns])
    c.token_counts.extend([len(op.tokens) for op in columns])
    c.tokens.extend([t for op in columns for t in op.tokens])
    c.hidden_offsets.extend([op.hidden.offset for op in columns])
    c.hidden_rows.extend([op.hidden.rows for op in columns])
    c.hidden_generations.extend([op.hidden.generation for op in columns])
    c.num_steps.extend([op.num_steps for op in columns])
    c.positions.extend([op.position for op in columns])
    c.topks.extend([op.topk for op in columns])
    c.num_draft_tokens.extend([op.num_draft_tokens for op in columns])
    c.temperatures.extend([op.sampling.temperature for op in columns])
    c.top_ps.extend([op.sampling.top_p for op in columns])
    c.top_ks.extend([op.sampling.top_k for op in columns])
    c.seeds.extend([op.sampling.seed for op in columns])
    if any(op.earlier for op in columns):
        c.earlier_counts.extend([len(op.earlier) for op in columns])
        c.earlier_offsets.extend([r.offset for op in columns for r in op.earlier])
        c.earlier_rows.extend([r.rows for op in columns for r in op.earlier])
        c.earlier_generations.extend([r.generation for op in columns for r in op.earlier])
    if any(op.trace for op in columns):
        c.traceparents.extend([op.trace for op in columns])


def draft_step_ops(m: draft_pb2.DraftStepRequest) -> list[DraftOp]:
    """The extend-and-proposes a request sends as columns; ValueError when they do not line up."""
    if not m.HasField("extend_proposes"):
        return []
    c = m.extend_proposes
    seq_ids = list(c.seq_ids)
    n = len(seq_ids)
    if not n:
        return []
    cols = [_column(n, name, list(getattr(c, name))) for name in (
        "token_counts", "hidden_offsets", "hidden_rows", "hidden_generations", "num_steps", "positions", "topks",
        "num_draft_tokens", "temperatures", "top_ps", "top_ks", "seeds")]
    counts, offsets, rows, generations, steps, positions, topks, sizes, temps, top_ps, top_ks, seeds = cols
    earlier_counts = _column(n, "earlier_counts", list(c.earlier_counts), 0)
    traces = _column(n, "traceparents", list(c.traceparents), "")
    tokens = _split(list(c.tokens), counts, "tokens")
    e_offsets, e_rows, e_gens = list(c.earlier_offsets), list(c.earlier_rows), list(c.earlier_generations)
    if not len(e_offsets) == len(e_rows) == len(e_gens):
        raise ValueError("the earlier references' columns differ in length")
    earlier = _split([HiddenRef(o, r, g) for o, r, g in zip(e_offsets, e_rows, e_gens, strict=True)],
                     earlier_counts, "earlier references")
    return [ExtendPropose(seq_ids[i], tokens[i], HiddenRef(offsets[i], rows[i], generations[i]), steps[i],
                          Sampling(temps[i], top_ps[i] if top_ps[i] > 0 else 1.0, top_ks[i], seeds[i]), traces[i],
                          positions[i], max(topks[i], 1), sizes[i], earlier[i]) for i in range(n)]


def write_draft_results(m: draft_pb2.DraftStepResponse, results: list[DraftResult]) -> None:
    """A step's results into m: successful ones without distributions as columns where there
    are DRAFT_COLUMNS_FROM of them, the others one message each."""
    ok, rest = _sort_out(results, lambda r: r.code == Code.OK and not r.draft_dists and not r.ahead,
                         DRAFT_COLUMNS_FROM)
    for r in rest:
        write_draft_result(m.results.add(), r)
    if not ok:
        return
    c = m.ok
    c.seq_ids.extend([r.seq_id for r in ok])
    _write_drafts(c, [r.draft_ids for r in ok], [r.draft_parents for r in ok])
    c.consumed_generations.extend([r.consumed_generation for r in ok])


def draft_results_from_proto(m: draft_pb2.DraftStepResponse) -> list[DraftResult]:
    """Every result of a step's response; ValueError when its columns do not line up."""
    out = [draft_result_from_proto(p) for p in m.results]
    if not m.HasField("ok"):
        return out
    c = m.ok
    seq_ids = list(c.seq_ids)
    n = len(seq_ids)
    if not n:
        return out
    generations = _column(n, "consumed_generations", list(c.consumed_generations))
    ids, parents = _read_drafts(c, n)
    return out + [DraftResult(seq_ids[i], draft_ids=ids[i], consumed_generation=generations[i],
                              draft_parents=parents[i]) for i in range(n)]


def _sort_out(items: list[T], fits: Callable[[T], bool], least: int) -> tuple[list[T], list[T]]:
    """(the items that fit the columns, where there are at least `least` of them, else none;
    the others, in order)."""
    fit = [fits(x) for x in items]
    if sum(fit) < least:
        return [], items
    return [x for x, f in zip(items, fit, strict=True) if f], [x for x, f in zip(items, fit, strict=True) if not f]


def _write_drafts(c: Any, ids: list[list[int]], parents: list[list[int]]) -> None:
    """Each sequence's drafts into the columns draft_counts and draft_ids, with tree and
    draft_parents where any is a tree (a chain has no parents)."""
    c.draft_counts.extend([len(x) for x in ids])
    c.draft_ids.extend([t for x in ids for t in x])
    if any(parents):
        c.tree.extend([bool(p) for p in parents])
        c.draft_parents.extend([q for p in parents for q in p])


def _read_drafts(c: Any, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each of n sequences' drafts and parents (empty: a chain), as _write_drafts wrote them."""
    counts = _column(n, "draft_counts", list(c.draft_counts))
    tree = _column(n, "tree", list(c.tree), False)
    parents = _split(list(c.draft_parents), [k if t else 0 for k, t in zip(counts, tree, strict=True)],
                     "draft_parents")
    return _split(list(c.draft_ids), counts, "draft_ids"), parents


_NO_DEFAULT = object()


def _column(n: int, name: str, values: list[T], default: object = _NO_DEFAULT) -> list[T]:
    """A column of n values; where it is empty, n defaults if it has one."""
    if not values and default is not _NO_DEFAULT:
        return [default] * n  # type: ignore[list-item]
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} sequences")
    return values


def _split(flat: list[T], counts: list[int], name: str) -> list[list[T]]:
    """flat cut into consecutive pieces of counts[i] each."""
    if sum(counts) != len(flat):
        raise ValueError(f"{name} has {len(flat)} entries where the counts add up to {sum(counts)}")
    ends = list(accumulate(counts))
    return [flat[end - k : end] for k, end in zip(counts, ends, strict=True)]


# the services' step codecs: every op and result, the many sequences' as columns
TARGET_CODEC = StepCodec(target_op_from_proto, write_target_result, TargetResult, target_pb2.TargetStepResponse,
                         target_step_verifies, write_target_results)
DRAFT_CODEC = StepCodec(draft_op_from_proto, write_draft_result, DraftResult, draft_pb2.DraftStepResponse,
                        draft_step_ops, write_draft_results)
