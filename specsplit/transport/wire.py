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


def sampling_to_proto(s: Sampling) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed)


def sampling_from_proto(p: common_pb2.SamplingParams) -> Sampling:
    return Sampling(p.temperature, p.top_p if p.top_p > 0 else 1.0, p.top_k, p.seed)


def ref_to_proto(r: HiddenRef | None) -> common_pb2.HiddenRef | None:
    if r is None:
        return None
    return common_pb2.HiddenRef(offset=r.offset, rows=r.rows, generation=r.generation, inline_rows=r.inline)


def ref_from_proto(p: common_pb2.HiddenRef) -> HiddenRef:
    return HiddenRef(p.offset, p.rows, p.generation, p.inline_rows)


def dists_to_proto(dists: list[SparseDist]) -> list[common_pb2.DraftDistribution]:
    return [common_pb2.DraftDistribution(token_ids=ids, probs=probs) for ids, probs in dists]


def dists_from_proto(ps: list[common_pb2.DraftDistribution]) -> list[SparseDist]:
    return [(list(p.token_ids), list(p.probs)) for p in ps]


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
def target_op_to_proto(op: TargetOp) -> target_pb2.TargetOp:
    if isinstance(op, Prefill):
        return target_pb2.TargetOp(seq_id=op.seq_id, traceparent=op.trace, prefill=target_pb2.TargetPrefill(
            prompt_ids=op.prompt_ids, sampling=sampling_to_proto(op.sampling), capture_hidden=op.capture))
    if isinstance(op, Verify):
        return target_pb2.TargetOp(seq_id=op.seq_id, traceparent=op.trace, verify=target_pb2.TargetVerify(
            draft_ids=op.draft_ids, draft_dists=dists_to_proto(op.draft_dists), capture_hidden=op.capture,
            draft_parents=op.draft_parents, forced_accept=op.forced if op.forced >= 0 else None))
    if isinstance(op, Recapture):
        return target_pb2.TargetOp(seq_id=op.seq_id, traceparent=op.trace, recapture=target_pb2.TargetRecapture())
    if isinstance(op, Suspend):
        return target_pb2.TargetOp(seq_id=op.seq_id, traceparent=op.trace, suspend=target_pb2.TargetSuspend())
    if isinstance(op, Resume):
        return target_pb2.TargetOp(seq_id=op.seq_id, traceparent=op.trace,
                                   resume=target_pb2.TargetResume(capture_hidden=op.capture))
    return target_pb2.TargetOp(seq_id=op.seq_id, traceparent=op.trace, release=target_pb2.TargetRelease())


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


def target_result_to_proto(r: TargetResult) -> target_pb2.TargetResult:
    return target_pb2.TargetResult(seq_id=r.seq_id, status=common_pb2.EntryStatus(code=int(r.code), message=r.message),
                                   tokens=r.tokens, num_accepted=r.num_accepted, hidden=ref_to_proto(r.hidden))


def target_result_from_proto(p: target_pb2.TargetResult) -> TargetResult:
    return TargetResult(p.seq_id, Code(p.status.code), p.status.message, list(p.tokens), p.num_accepted,
                        ref_from_proto(p.hidden) if p.HasField("hidden") else None)


# -- draft
def draft_op_to_proto(op: DraftOp) -> draft_pb2.DraftOp:
    if isinstance(op, ExtendPropose):
        return draft_pb2.DraftOp(seq_id=op.seq_id, traceparent=op.trace, extend_propose=draft_pb2.DraftExtendPropose(
            tokens=op.tokens, hidden=ref_to_proto(op.hidden), num_steps=op.num_steps,
            sampling=sampling_to_proto(op.sampling), position=op.position, topk=op.topk,
            num_draft_tokens=op.num_draft_tokens, earlier=[ref_to_proto(r) for r in op.earlier]))
    return draft_pb2.DraftOp(seq_id=op.seq_id, traceparent=op.trace, release=draft_pb2.DraftRelease())


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


def draft_result_to_proto(r: DraftResult) -> draft_pb2.DraftResult:
    return draft_pb2.DraftResult(seq_id=r.seq_id, status=common_pb2.EntryStatus(code=int(r.code), message=r.message),
                                 draft_ids=r.draft_ids, draft_dists=dists_to_proto(r.draft_dists),
                                 consumed_generation=r.consumed_generation, draft_parents=r.draft_parents)


def draft_result_from_proto(p: draft_pb2.DraftResult) -> DraftResult:
    return DraftResult(p.seq_id, Code(p.status.code), p.status.message, list(p.draft_ids),
                       dists_from_proto(p.draft_dists), p.consumed_generation, draft_parents=list(p.draft_parents))
