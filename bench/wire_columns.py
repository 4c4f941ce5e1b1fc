"""A step's wire cost for its many sequences: its ops encoded, serialized, parsed and decoded,
and its results likewise, one message a sequence (specsplit.transport.wire) against columns
(specsplit.transport.columns, what the gateway and the services send from COLUMNS_FROM /
DRAFT_COLUMNS_FROM sequences a step), side by side in one process. One JSON line per (step,
batch): µs a step each way and their ratio.

  python -m bench.wire_columns --batch 1,4,8,32
"""

from __future__ import annotations

import argparse
import json
import platform
import timeit
from collections.abc import Callable
from typing import Any

from bench.spec_vs_baseline import git_commit
from specsplit.ops import DraftResult, ExtendPropose, HiddenRef, Sampling, TargetResult, Verify
from specsplit.transport import columns, wire
from specsplit.v1 import draft_pb2, target_pb2

TREE = list(range(-1, 2)) + [i // 4 for i in range(12)]  # 15 drafts of a topk-4 tree


def steps(b: int) -> dict[str, tuple[list[Any], list[Any]]]:
    """Each kind of step of b sequences: (ops, results)."""
    return {
        "target decode": ([Verify(i, [], capture=False) for i in range(b)],
                          [TargetResult(i, tokens=[5]) for i in range(b)]),
        "target tree verify": ([Verify(i, list(range(100, 115)), draft_parents=TREE) for i in range(b)],
                               [TargetResult(i, tokens=[5, 6, 7], num_accepted=2, hidden=HiddenRef(i, 3, i))
                                for i in range(b)]),
        "draft tree": ([ExtendPropose(i, [5, 6, 7], HiddenRef(i, 3, i), 5, Sampling(), "", 64, 4, 16)
                        for i in range(b)],
                       [DraftResult(i, draft_ids=list(range(100, 115)), draft_parents=TREE, consumed_generation=i)
                        for i in range(b)]),
    }


def messages(target: bool, ops: list[Any], results: list[Any]) -> Callable[[], None]:
    req_t, res_t = ((target_pb2.TargetStepRequest, target_pb2.TargetStepResponse) if target
                    else (draft_pb2.DraftStepRequest, draft_pb2.DraftStepResponse))
    write_op, read_op = ((wire.write_target_op, wire.target_op_from_proto) if target
                         else (wire.write_draft_op, wire.draft_op_from_proto))
    write_res, read_res = ((wire.write_target_result, wire.target_result_from_proto) if target
                           else (wire.write_draft_result, wire.draft_result_from_proto))

    def run() -> None:
        req = req_t()
        for op in ops:
            write_op(req.ops.add(), op)
        got = [read_op(p) for p in req_t.FromString(req.SerializeToString()).ops]
        res = res_t()
        for r in results:
            write_res(res.results.add(), r)
        back = [read_res(p) for p in res_t.FromString(res.SerializeToString()).results]
        assert len(got) == len(ops) and len(back) == len(results)

    return run


def in_columns(target: bool, ops: list[Any], results: list[Any]) -> Callable[[], None]:
    req_t, res_t = ((target_pb2.TargetStepRequest, target_pb2.TargetStepResponse) if target
                    else (draft_pb2.DraftStepRequest, draft_pb2.DraftStepResponse))
    write_ops, more_ops = ((columns.write_target_step, columns.target_step_verifies) if target
                           else (columns.write_draft_step, columns.draft_step_ops))
    read_op = wire.target_op_from_proto if target else wire.draft_op_from_proto
    write_res, read_res = ((columns.write_target_results, columns.target_results_from_proto) if target
                           else (columns.write_draft_results, columns.draft_results_from_proto))

    def run() -> None:
        req = req_t()
        write_ops(req, ops)
        parsed = req_t.FromString(req.SerializeToString())
        got = [read_op(p) for p in parsed.ops] + more_ops(parsed)
        res = res_t()
        write_res(res, results)
        back = read_res(res_t.FromString(res.SerializeToString()))
        assert len(got) == len(ops) and len(back) == len(results)

    return run


def best_us(fn: Callable[[], None], calls: int, rounds: int) -> float:
    return min(timeit.repeat(fn, number=calls, repeat=rounds)) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,4,8,32", help="sequences a step, comma-separated")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5, help="the best round is reported")
    a = p.parse_args()
    common = {"bench": "wire_columns", "commit": git_commit(), "python": platform.python_version(),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip()}
    for b in (int(x) for x in a.batch.split(",")):
        for name, (ops, results) in steps(b).items():
            target = name.startswith("target")
            one = best_us(messages(target, ops, results), a.calls, a.rounds)
            cols = best_us(in_columns(target, ops, results), a.calls, a.rounds)
            print(json.dumps({**common, "step": name, "batch": b, "messages_us": round(one, 1),
                              "sent_us": round(cols, 1), "sent_over_messages": round(cols / one, 3)}), flush=True)


if __name__ == "__main__":
    main()
