"""The step messages (specsplit.transport.wire): every op and result the engines exchange comes
back from its serialized message as it went in, defaults and empty fields included."""

from __future__ import annotations

import pytest

from specsplit.ops import (
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
from specsplit.transport import wire
from specsplit.v1 import draft_pb2, target_pb2

SAMPLED = Sampling(temperature=0.75, top_p=0.875, top_k=40, seed=12)  # fields are float32 on the wire
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


TARGET_OPS = [
    Prefill(1, [5, 6, 7], SAMPLED, True, TRACE),
    Prefill(2, [5], Sampling(), False),
    Verify(3),  # a decode: no drafts, nothing else set
    Verify(4, capture=False),
    Verify(5, [8, 9, 10], [([8, 11], [0.75, 0.25]), ([9], [1.0]), ([10, 2], [0.5, 0.5])], capture=True, trace=TRACE),
    Verify(6, [8, 9, 10, 12], draft_parents=[-1, -1, 0, 2], forced=2),
    Verify(7, [8], forced=0),
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
    Release(4, TRACE),
]
DRAFT_RESULTS = [
    DraftResult(1, draft_ids=[8, 9, 10], consumed_generation=3),
    DraftResult(2, draft_ids=[8, 9, 10, 11], draft_parents=[-1, -1, 0, 1], consumed_generation=4),
    DraftResult(3, draft_ids=[8, 9], draft_dists=[([8, 2], [0.5, 0.5]), ([9], [1.0])], consumed_generation=5),
    DraftResult(4, Code.INVALID_ARGUMENT, "token id outside the vocabulary", consumed_generation=6),
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
