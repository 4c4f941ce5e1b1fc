"""The step messages (specsplit.transport.wire): every op and result the engines exchange comes
back from its serialized message as it went in, defaults and empty fields included."""

from __future__ import annotations

import pytest

from specsplit.ops import (
    AheadOutcome,
    Code,
    DraftResult,
    ExtendPropose,
    HiddenRef,
    Prefill,
    Recapture,
    Release,
    Resume,
    Sampling,
    Suspend,
    TargetResult,
    Verify,
)
from specsplit.transport import columns, wire
from specsplit.v1 import draft_pb2, target_pb2

SAMPLED = Sampling(temperature=0.75, top_p=0.875, top_k=40, seed=12)  # fields are float32 on the wire
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


TARGET_OPS = [
    Prefill(1, [5, 6, 7], SAMPLED, True, TRACE),
    Prefill(2, [5], Sampling(), False),
    Prefill(3, [8, 9], SAMPLED, True, TRACE, start=12, more=True),
    Verify(3),  # a decode: no drafts, nothing else set
    Verify(4, capture=False),
    Verify(5, [8, 9, 10], [([8, 11], [0.75, 0.25]), ([9], [1.0]), ([10, 2], [0.5, 0.5])], capture=True, trace=TRACE),
    Verify(6, [8, 9, 10, 12], draft_parents=[-1, -1, 0, 2], forced=2),
    Verify(7, [8], forced=0),
    Verify(13, capture=False, decode=8),
    Release(8, TRACE),
    Recapture(9),
    Suspend(10),
    Resume(11, capture=False),
    Resume(12, capture=True, trace=TRACE),
]
TARGET_RESULTS = [
    TargetResult(1, tokens=[4, 5, 6], num_accepted=2, hidden=HiddenRef(100, 3, 7)),
    TargetResult(2, tokens=[4], hidden=HiddenRef(0, 1, 1, b"\x01\x02")),
    TargetResult(3, Code.RESOURCE_EXHAUSTED, "hidden-state ring full; retry next cycle"),
]
DRAFT_OPS = [
    ExtendPropose(1, [5, 6], HiddenRef(10, 2, 3), 5, SAMPLED, TRACE, 40, 1, 0),
    ExtendPropose(2, [5], HiddenRef(0, 1, 4), 0),
    ExtendPropose(3, [5, 6, 7], HiddenRef(20, 1, 9), 5, Sampling(), "", 50, 4, 16,
                  [HiddenRef(12, 1, 7), HiddenRef(14, 1, 8, b"\x00")]),
    ExtendPropose(5, [], HiddenRef(0, 0, 0), 3, position=30, ahead=[8, 9, 10]),  # drafting ahead, no extend
    ExtendPropose(6, [5], HiddenRef(3, 1, 2), 3, position=9, ahead=[8, 9, 10], ahead_parents=[-1, -1, 0]),
    Release(4, TRACE),
]
DRAFT_RESULTS = [
    DraftResult(1, draft_ids=[8, 9, 10], consumed_generation=3),
    DraftResult(2, draft_ids=[8, 9, 10, 11], draft_parents=[-1, -1, 0, 1], consumed_generation=4),
    DraftResult(3, draft_ids=[8, 9], draft_dists=[([8, 2], [0.5, 0.5]), ([9], [1.0])], consumed_generation=5),
    DraftResult(4, Code.INVALID_ARGUMENT, "token id outside the vocabulary", consumed_generation=6),
    DraftResult(5, ahead=[AheadOutcome(3, 0, [3, 4], node=2), AheadOutcome(0, 7, [5, 6], [-1, 0])]),  # drafted ahead
]
# (message holding a list of them, that list's field, writer, reader)
CODECS = {
    "target op": (target_pb2.TargetStepRequest, "ops", wire.write_target_op, wire.target_op_from_proto),
    "target result": (target_pb2.TargetStepResponse, "results", wire.write_target_result,
                      wire.target_result_from_proto),
    "draft op": (draft_pb2.DraftStepRequest, "ops", wire.write_draft_op, wire.draft_op_from_proto),
    "draft result": (draft_pb2.DraftStepResponse, "results", wire.write_draft_result, wire.draft_result_from_proto),
}
CASES = [(kind, value) for kind, values in (("target op", TARGET_OPS), ("target result", TARGET_RESULTS),
                                            ("draft op", DRAFT_OPS), ("draft result", DRAFT_RESULTS))
         for value in values]


@pytest.mark.parametrize("kind, value", CASES)
def test_step_messages_round_trip(kind: str, value: object) -> None:
    message, field, write, read = CODECS[kind]
    out = message(step_id=1)
    write(getattr(out, field).add(), value)
    (p,) = getattr(message.FromString(out.SerializeToString()), field)
    assert read(p) == value


def test_an_unknown_status_code_is_refused() -> None:
    assert wire.code_from_proto(3) is Code.RESOURCE_EXHAUSTED
    with pytest.raises(ValueError):
        wire.code_from_proto(99)


def _by_id(items: list) -> dict:  # type: ignore[type-arg]
    return {x.seq_id: x for x in items}


@pytest.mark.parametrize("ops", [TARGET_OPS, [Verify(i) for i in range(1, 33)],
                                 [Verify(1, [8, 9], draft_parents=[-1, 0]), Verify(2, [7]), Verify(3, trace=TRACE),
                                  Verify(4, [6], forced=1), Verify(5, capture=False)],
                                 [Verify(i, capture=False, decode=4) for i in range(1, 9)],
                                 [Verify(1, [8, 9]), Prefill(2, [5])]],
                         ids=["every kind", "32 decodes", "a tree, a chain, decodes, a forced chain",
                              "decodes of several tokens", "a few"])
def test_a_step_of_many_ops_round_trips_with_its_verifies_as_columns(ops: list) -> None:  # type: ignore[type-arg]
    req = target_pb2.TargetStepRequest(step_id=1)
    columns.write_target_step(req, ops)
    back = target_pb2.TargetStepRequest.FromString(req.SerializeToString())
    got = [wire.target_op_from_proto(p) for p in back.ops] + columns.target_step_verifies(back)
    assert len(got) == len(ops) and _by_id(got) == _by_id(ops)
    sent = [op for op in ops if isinstance(op, Verify) and not op.draft_dists]
    if len(sent) < columns.COLUMNS_FROM:  # a few go one by one
        sent = []
    assert len(back.verifies.seq_ids) == len(sent)  # only verifies with distributions go one by one
    assert [op.seq_id for op in got[len(back.ops):]] == [op.seq_id for op in sent]  # in their order


def test_a_step_of_many_results_round_trips_with_the_successful_ones_as_columns() -> None:
    results = [*TARGET_RESULTS, *(TargetResult(10 + i, tokens=[i] * (i % 3 + 1), num_accepted=i % 3,
                                               hidden=HiddenRef(i, i % 3 + 1, 50 + i) if i % 2 else None)
                                  for i in range(32))]
    m = target_pb2.TargetStepResponse(step_id=1)
    columns.write_target_results(m, results)
    back = target_pb2.TargetStepResponse.FromString(m.SerializeToString())
    got = columns.target_results_from_proto(back)
    assert len(got) == len(results) and _by_id(got) == _by_id(results)
    assert len(back.results) == 2  # the failure, and the rows sent inline


@pytest.mark.parametrize("break_it", [
    lambda c: c.draft_ids.append(3),
    lambda c: c.capture_hidden.pop(),
    lambda c: c.draft_counts.append(0),
    lambda c: c.forced_accept.extend([1]),
    lambda c: c.decode_tokens.extend([2]),
    lambda c: (c.tree.extend([True] + [False] * 7), c.draft_parents.extend([-1])),
], ids=["a draft too many", "a capture flag missing", "a count too many", "a forced count missing",
        "a decode count missing", "a tree's parent missing"])
def test_verify_columns_that_do_not_line_up_are_refused(break_it: object) -> None:
    req = target_pb2.TargetStepRequest(step_id=1)
    columns.write_target_step(req, [Verify(1, [8, 9]), *(Verify(i) for i in range(2, 8)), Verify(8, [7])])
    break_it(req.verifies)  # type: ignore[operator]
    with pytest.raises(ValueError):
        columns.target_step_verifies(req)


def test_result_columns_that_do_not_line_up_are_refused() -> None:
    m = target_pb2.TargetStepResponse(step_id=1)
    columns.write_target_results(m, [TargetResult(i, tokens=[4, 5], num_accepted=1) for i in range(8)])
    m.ok.tokens.append(6)
    with pytest.raises(ValueError):
        columns.target_results_from_proto(m)


def test_the_target_service_refuses_a_step_whose_columns_do_not_line_up() -> None:
    import grpc

    from specsplit.transport.step_stream import StepAbort, answer_step

    req = target_pb2.TargetStepRequest(step_id=1)
    columns.write_target_step(req, [Verify(i, [8, 9]) for i in range(8)])
    req.verifies.draft_ids.append(3)
    ran = []
    with pytest.raises(StepAbort) as e:
        answer_step(req, "target", lambda ops, _req: ran.append(ops), columns.TARGET_CODEC)  # type: ignore[arg-type,func-returns-value]
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and not ran
    assert "draft_ids has 17 entries" in e.value.message


MANY_EXTENDS = [ExtendPropose(10 + i, [5] * (i % 3 + 1), HiddenRef(i, 1, 30 + i), i % 6, topk=1 + i % 2 * 3,
                              num_draft_tokens=i % 2 * 16, position=64 + i) for i in range(32)]


@pytest.mark.parametrize("ops", [DRAFT_OPS, [*DRAFT_OPS, *MANY_EXTENDS]], ids=["a few", "32 sequences and every kind"])
def test_a_draft_step_of_many_ops_round_trips_with_its_extends_as_columns(ops: list) -> None:  # type: ignore[type-arg]
    req = draft_pb2.DraftStepRequest(step_id=1)
    columns.write_draft_step(req, ops)
    back = draft_pb2.DraftStepRequest.FromString(req.SerializeToString())
    got = [wire.draft_op_from_proto(p) for p in back.ops] + columns.draft_step_ops(back)
    assert len(got) == len(ops) and _by_id(got) == _by_id(ops)
    sent = [op for op in ops if isinstance(op, ExtendPropose) and not op.hidden.inline and not op.ahead
            and not any(r.inline for r in op.earlier)]  # not a release, nor inline rows, nor drafting ahead
    assert len(back.extend_proposes.seq_ids) == (len(sent) if len(sent) >= columns.DRAFT_COLUMNS_FROM else 0)


def test_a_draft_step_of_many_results_round_trips_with_the_successful_ones_as_columns() -> None:
    results = [*DRAFT_RESULTS, *(DraftResult(10 + i, draft_ids=[8] * (i % 4), consumed_generation=20 + i,
                                             draft_parents=list(range(-1, i % 4 - 1)) if i % 2 else [])
                                 for i in range(32))]
    m = draft_pb2.DraftStepResponse(step_id=1)
    columns.write_draft_results(m, results)
    back = draft_pb2.DraftStepResponse.FromString(m.SerializeToString())
    got = columns.draft_results_from_proto(back)
    assert len(got) == len(results) and _by_id(got) == _by_id(results)
    assert len(back.results) == 3  # the failure, the sampled proposal and the one drafted ahead


@pytest.mark.parametrize("break_it", [
    lambda c: c.tokens.append(3),
    lambda c: c.seeds.pop(),
    lambda c: c.earlier_counts.extend([1, 0, 0, 0, 0, 0, 0, 0]),
    lambda c: c.traceparents.append(""),
], ids=["a token too many", "a seed missing", "an earlier reference missing", "a trace too few"])
def test_extend_columns_that_do_not_line_up_are_refused(break_it: object) -> None:
    req = draft_pb2.DraftStepRequest(step_id=1)
    columns.write_draft_step(req, [ExtendPropose(i, [5, 6], HiddenRef(i, 2, i), 3) for i in range(8)])
    break_it(req.extend_proposes)  # type: ignore[operator]
    with pytest.raises(ValueError):
        columns.draft_step_ops(req)
