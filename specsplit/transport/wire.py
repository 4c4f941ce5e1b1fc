"""Conversions between the engines' plain-Python ops and the specsplit.v1 protos."""

from __future__ import annotations

from specsplit.ops import (
    AheadOutcome,
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
        if op.decode != 1:
            v.decode_tokens = op.decode
    elif isinstance(op, Prefill):
        m.prefill.SetInParent()
        m.prefill.prompt_ids.extend(op.prompt_ids)
        write_sampling(m.prefill.sampling, op.sampling)
        m.prefill.capture_hidden = op.capture
        m.prefill.start = op.start
        m.prefill.more = op.more
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
                       p.prefill.capture_hidden, p.traceparent, p.prefill.start, p.prefill.more)
    if kind == "verify":
        return Verify(p.seq_id, list(p.verify.draft_ids), dists_from_proto(p.verify.draft_dists),
                      list(p.verify.draft_parents), p.verify.capture_hidden, p.traceparent,
                      p.verify.forced_accept if p.verify.HasField("forced_accept") else -1,
                      p.verify.decode_tokens if p.verify.HasField("decode_tokens") else 1)
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
        e.ahead.extend(op.ahead)
        e.ahead_parents.extend(op.ahead_parents)
    else:
        m.release.SetInParent()


def draft_op_from_proto(p: draft_pb2.DraftOp) -> DraftOp | None:
    kind = p.WhichOneof("op")
    if kind == "extend_propose":
        e = p.extend_propose
        return ExtendPropose(p.seq_id, list(e.tokens), ref_from_proto(e.hidden), e.num_steps,
                             sampling_from_proto(e.sampling), p.traceparent, e.position, max(e.topk, 1),
                             e.num_draft_tokens, [ref_from_proto(r) for r in e.earlier], list(e.ahead),
                             list(e.ahead_parents))
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
    for o in r.ahead:
        a = m.ahead.add()
        a.accepted, a.bonus, a.node = o.accepted, o.bonus, o.node
        a.draft_ids.extend(o.draft_ids)
        a.draft_parents.extend(o.draft_parents)


def draft_result_from_proto(p: draft_pb2.DraftResult) -> DraftResult:
    return DraftResult(p.seq_id, code_from_proto(p.status.code), p.status.message, list(p.draft_ids),
                       dists_from_proto(p.draft_dists), p.consumed_generation, draft_parents=list(p.draft_parents),
                       ahead=[AheadOutcome(a.accepted, a.bonus, list(a.draft_ids), list(a.draft_parents), a.node)
                              for a in p.ahead])
