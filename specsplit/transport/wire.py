"""Conversions between the engines' plain-Python ops and the specsplit.v1 protos."""

from __future__ import annotations

from specsplit.ops import (
    Code,
    DraftOp,
    DraftResult,
    ExtendPropose,
    HiddenRef,
    Prefill,
    Recapture,
    Release,
    Resume,
    Sampling,
    SparseDist,
    StepTiming,
    Suspend,
    TargetOp,
    TargetResult,
    Verify,
)
from specsplit.transport.handoff.base import Descriptor
from specsplit.v1 import common_pb2, draft_pb2, target_pb2


def sampling_from_proto(p: common_pb2.SamplingParams) -> Sampling:
    return Sampling(p.temperature, p.top_p if p.top_p > 0 else 1.0, p.top_k, p.seed)


def ref_from_proto(p: common_pb2.HiddenRef) -> HiddenRef:
    return HiddenRef(p.offset, p.rows, p.generation, p.inline_rows)


def dists_to_proto(dists: list[SparseDist]) -> list[common_pb2.DraftDistribution]:
    return [common_pb2.DraftDistribution(token_ids=ids, probs=probs) for ids, probs in dists]


def dists_from_proto(ps: list[common_pb2.DraftDistribution]) -> list[SparseDist]:
    return [(list(p.token_ids), list(p.probs)) for p in ps] if ps else []


_CODES = {int(c): c for c in Code}


def code_from_proto(value: int) -> Code:
    """An entry's status code (a dictionary lookup: Code(value) costs a microsecond); unknown
    values raise ValueError as Code(value) does."""
    return _CODES[value] if value in _CODES else Code(value)


def descriptor_to_proto(d: Descriptor) -> common_pb2.HiddenStoreDescriptor:
    return common_pb2.HiddenStoreDescriptor(backend=d.backend, name=d.name, capacity_rows=d.capacity_rows,
                                            width=d.width, dtype=d.dtype, handle=d.handle,
                                            device=d.device if d.device >= 0 else None)


def descriptor_from_proto(p: common_pb2.HiddenStoreDescriptor) -> Descriptor:
    return Descriptor(p.backend, p.name, p.capacity_rows, p.width, p.dtype, p.handle,
                      p.device if p.HasField("device") else -1)


def timing_to_proto(t: StepTiming) -> common_pb2.ServerTiming:
    return common_pb2.ServerTiming(compute_ms=t.compute_ms, total_ms=t.total_ms)


# -- target
def write_sampling(m: common_pb2.SamplingParams, s: Sampling) -> None:
    m.temperature, m.top_p, m.top_k, m.seed = s.temperature, s.top_p, s.top_k, s.seed


def write_ref(m: common_pb2.HiddenRef, r: HiddenRef) -> None:
    m.offset, m.rows, m.generation = r.offset, r.rows, r.generation
    if r.inline:
        m.inline_rows = r.inline


def write_target_op(m: target_pb2.TargetOp, op: TargetOp) -> None:
    """op into m, a fresh message (e.g. `request.ops.add()`): filled in place, nothing copied."""
    m.seq_id, m.traceparent = op.seq_id, op.trace
    if isinstance(op, Verify):
        v = m.verify
        v.SetInParent()  # a decode (no drafts, nothing captured) sets no field of its own
        v.draft_ids.extend(op.draft_ids)
        if op.draft_dists:
            v.draft_dists.extend(dists_to_proto(op.draft_dists))
        v.capture_hidden = op.capture
        v.draft_parents.extend(op.draft_parents)
        if op.forced >= 0:
            v.forced_accept = op.forced
    elif isinstance(op, Prefill):
        m.prefill.SetInParent()
        m.prefill.prompt_ids.extend(op.prompt_ids)
        write_sampling(m.prefill.sampling, op.sampling)
        m.prefill.capture_hidden = op.capture
    elif isinstance(op, Recapture):
        m.recapture.SetInParent()
    elif isinstance(op, Suspend):
        m.suspend.SetInParent()
    elif isinstance(op, Resume):
        m.resume.SetInParent()
        m.resume.capture_hidden = op.capture
    else:
        m.release.SetInParent()


def target_op_from_proto(p: target_pb2.TargetOp) -> TargetOp | None:
    kind = p.WhichOneof("op")
    if kind == "prefill":
        return Prefill(p.seq_id, list(p.prefill.prompt_ids), sampling_from_proto(p.prefill.sampling),
                       p.prefill.capture_hidden, p.traceparent)
    if kind == "verify":
        return Verify(p.seq_id, list(p.verify.draft_ids), dists_from_proto(p.verify.draft_dists),
                      list(p.verify.draft_parents), p.verify.capture_hidden, p.traceparent,
                      p.verify.forced_accept if p.verify.HasField("forced_accept") else -1)
    if kind == "release":
        return Release(p.seq_id, p.traceparent)
    if kind == "recapture":
        return Recapture(p.seq_id, p.traceparent)
    if kind == "suspend":
        return Suspend(p.seq_id, p.traceparent)
    if kind == "resume":
        return Resume(p.seq_id, p.resume.capture_hidden, p.traceparent)
    return None


def write_target_result(m: target_pb2.TargetResult, r: TargetResult) -> None:
    m.seq_id, m.num_accepted = r.seq_id, r.num_accepted
    m.status.code, m.status.message = int(r.code), r.message
    m.tokens.extend(r.tokens)
    if r.hidden is not None:
        write_ref(m.hidden, r.hidden)


def target_result_from_proto(p: target_pb2.TargetResult) -> TargetResult:
    return TargetResult(p.seq_id, code_from_proto(p.status.code), p.status.message, list(p.tokens), p.num_accepted,
                        ref_from_proto(p.hidden) if p.HasField("hidden") else None)


# -- a step's many sequences, column by column (target.proto: VerifyColumns, ResultColumns)
COLUMNS_FROM = 4  # sequences: fewer cost less as messages of their own (a column costs a few calls to read)


def write_target_step(m: target_pb2.TargetStepRequest, ops: list[TargetOp]) -> None:
    """A step's ops into m: verifies without draft distributions as columns where there are
    COLUMNS_FROM of them, the others one message each."""
    columns = [op for op in ops if type(op) is Verify and not op.draft_dists]
    if len(columns) < COLUMNS_FROM:
        columns = []
    for op in ops:
        if not columns or type(op) is not Verify or op.draft_dists:
            write_target_op(m.ops.add(), op)
    if not columns:
        return
    c = m.verifies
    c.seq_ids.extend([op.seq_id for op in columns])
    c.capture_hidden.extend([op.capture for op in columns])
    c.draft_counts.extend([len(op.draft_ids) for op in columns])
    c.draft_ids.extend([t for op in columns for t in op.draft_ids])
    if any(op.draft_parents for op in columns):
        c.tree.extend([bool(op.draft_parents) for op in columns])
        c.draft_parents.extend([p for op in columns for p in op.draft_parents])
    if any(op.forced >= 0 for op in columns):
        c.forced_accept.extend([op.forced for op in columns])
    if any(op.trace for op in columns):
        c.traceparents.extend([op.trace for op in columns])


def _columns(n: int, name: str, values: list, default: object) -> list:  # type: ignore[type-arg]
    """A column of n values, or n defaults where it is empty; ValueError when neither."""
    if not values:
        return [default] * n
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} sequences")
    return values


def target_step_verifies(m: target_pb2.TargetStepRequest) -> list[Verify]:
    """The verifies a request sends as columns; ValueError when they do not line up."""
    if not m.HasField("verifies"):
        return []
    c = m.verifies
    seq_ids = list(c.seq_ids)
    n = len(seq_ids)
    if not n:
        return []
    capture = _columns(n, "capture_hidden", list(c.capture_hidden), None)
    counts = _columns(n, "draft_counts", list(c.draft_counts), None)
    tree = _columns(n, "tree", list(c.tree), False)
    forced = _columns(n, "forced_accept", list(c.forced_accept), -1)
    traces = _columns(n, "traceparents", list(c.traceparents), "")
    ids, parents = list(c.draft_ids), list(c.draft_parents)
    if None in capture or None in counts:
        raise ValueError("verify columns need capture_hidden and draft_counts for every sequence")
    if sum(counts) != len(ids):
        raise ValueError(f"draft_counts add up to {sum(counts)}, draft_ids has {len(ids)}")
    if sum(k for k, t in zip(counts, tree, strict=True) if t) != len(parents):
        raise ValueError("draft_parents does not hold one parent per draft of each tree")
    out, at, at_parent = [], 0, 0
    for i in range(n):
        k = counts[i]
        drafts, at = ids[at : at + k], at + k
        tree_parents: list[int] = []
        if tree[i]:
            tree_parents, at_parent = parents[at_parent : at_parent + k], at_parent + k
        out.append(Verify(seq_ids[i], drafts, [], tree_parents, capture[i], traces[i], forced[i]))
    return out


def write_target_results(m: target_pb2.TargetStepResponse, results: list[TargetResult]) -> None:
    """A step's results into m: successful ones without inline rows as columns where there are
    COLUMNS_FROM of them, the others one message each."""
    ok = [r for r in results if r.code == Code.OK and (r.hidden is None or not r.hidden.inline)]
    if len(ok) < COLUMNS_FROM:
        ok = []
    for r in results:
        if not ok or r.code != Code.OK or (r.hidden is not None and r.hidden.inline):
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
    counts, tokens, accepted = list(c.token_counts), list(c.tokens), list(c.num_accepted)
    rows, offsets, generations = list(c.hidden_rows), list(c.hidden_offsets), list(c.hidden_generations)
    if any(len(col) != n for col in (counts, accepted, rows, offsets, generations)) or sum(counts) != len(tokens):
        raise ValueError("the result columns do not line up")
    at = 0
    for i in range(n):
        k = counts[i]
        hidden = HiddenRef(offsets[i], rows[i], generations[i]) if rows[i] else None
        out.append(TargetResult(seq_ids[i], tokens=tokens[at : at + k], num_accepted=accepted[i], hidden=hidden))
        at += k
    return out


# -- draft
def write_draft_op(m: draft_pb2.DraftOp, op: DraftOp) -> None:
    """op into m, a fresh message (e.g. `request.ops.add()`): filled in place, nothing copied."""
    m.seq_id, m.traceparent = op.seq_id, op.trace
    if isinstance(op, ExtendPropose):
        e = m.extend_propose
        e.SetInParent()
        e.tokens.extend(op.tokens)
        write_ref(e.hidden, op.hidden)
        e.num_steps, e.position, e.topk, e.num_draft_tokens = op.num_steps, op.position, op.topk, op.num_draft_tokens
        write_sampling(e.sampling, op.sampling)
        for r in op.earlier:
            write_ref(e.earlier.add(), r)
    else:
        m.release.SetInParent()


def draft_op_from_proto(p: draft_pb2.DraftOp) -> DraftOp | None:
    kind = p.WhichOneof("op")
    if kind == "extend_propose":
        e = p.extend_propose
        return ExtendPropose(p.seq_id, list(e.tokens), ref_from_proto(e.hidden), e.num_steps,
                             sampling_from_proto(e.sampling), p.traceparent, e.position, max(e.topk, 1),
                             e.num_draft_tokens, [ref_from_proto(r) for r in e.earlier])
    if kind == "release":
        return Release(p.seq_id, p.traceparent)
    return None


def write_draft_result(m: draft_pb2.DraftResult, r: DraftResult) -> None:
    m.seq_id, m.consumed_generation = r.seq_id, r.consumed_generation
    m.status.code, m.status.message = int(r.code), r.message
    m.draft_ids.extend(r.draft_ids)
    if r.draft_dists:
        m.draft_dists.extend(dists_to_proto(r.draft_dists))
    m.draft_parents.extend(r.draft_parents)


def draft_result_from_proto(p: draft_pb2.DraftResult) -> DraftResult:
    return DraftResult(p.seq_id, code_from_proto(p.status.code), p.status.message, list(p.draft_ids),
                       dists_from_proto(p.draft_dists), p.consumed_generation, draft_parents=list(p.draft_parents))
