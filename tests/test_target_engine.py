"""Target engine entry-level behaviour: errors, slots and ring backpressure."""

from __future__ import annotations

from pathlib import Path

import torch

from specsplit.models.parallel import TensorParallel
from specsplit.ops import Code, Prefill, Recapture, Release, Sampling, Verify
from target_service.config import TargetConfig
from target_service.runtime import TargetRuntime


def runtime(tiny_target: Path, max_context: int = 64, max_sequences: int = 2, **kw: int) -> TargetRuntime:
    cfg = TargetConfig(model=str(tiny_target), max_context=max_context, max_sequences=max_sequences, **kw).validate()
    return TargetRuntime(cfg, TensorParallel())


def test_errors_are_per_entry_and_state_is_kept(tiny_target: Path) -> None:
    rt = runtime(tiny_target)
    try:
        res, _ = rt.step([Prefill(1, [1, 2, 3]), Verify(7, [1]), Prefill(2, [1, 99999]), Prefill(3, [])], [])
        assert [r.code for r in res] == [Code.OK, Code.NOT_FOUND, Code.INVALID_ARGUMENT, Code.INVALID_ARGUMENT]
        assert "outside the vocabulary" in res[2].message and "empty prompt" in res[3].message
        assert res[0].hidden is not None and res[0].hidden.rows == 3 and len(res[0].tokens) == 1
        res, _ = rt.step([Verify(1, [5, 6])], [res[0].hidden.generation])
        assert res[0].code == Code.OK and 1 <= len(res[0].tokens) <= 3
        assert res[0].hidden.rows == res[0].num_accepted + 1
    finally:
        rt.close()


def test_malformed_verifies_are_refused_one_by_one(tiny_target: Path) -> None:
    rt = runtime(tiny_target, max_context=16, max_sequences=3)
    try:
        res, _ = rt.step([Prefill(1, [1, 2, 3], capture=False),
                          Prefill(2, [1, 2], Sampling(temperature=0.5), capture=False)], [])
        assert [r.code for r in res] == [Code.OK, Code.OK]
        bad = {"parents for 0 draft tokens": Verify(1, [], draft_parents=[-1], capture=False),
               "one draft distribution per token": Verify(2, [], draft_dists=[([5], [1.0])], capture=False),
               "outside the vocabulary": Verify(1, [99999], capture=False),
               "exceed the limit": Verify(1, [5] * 17, capture=False),
               "would exceed the context": Verify(1, [5] * 13, capture=False),
               "benchmark mode": Verify(1, [5], capture=False, forced=1)}
        for why, op in bad.items():
            (r,), _ = rt.step([op], [])
            assert r.code == Code.INVALID_ARGUMENT and why in r.message, (why, r.message)
        res, _ = rt.step([Verify(1, [5], capture=False), Verify(2, capture=False)], [])  # both as they were
        assert [r.code for r in res] == [Code.OK, Code.OK]
    finally:
        rt.close()


def test_slots_run_out_then_come_back(tiny_target: Path) -> None:
    rt = runtime(tiny_target)
    try:
        res, _ = rt.step([Prefill(i, [1, 2], capture=False) for i in (1, 2, 3)], [])
        assert [r.code for r in res] == [Code.OK, Code.OK, Code.RESOURCE_EXHAUSTED]
        rt.step([Release(1)], [])
        res, _ = rt.step([Prefill(3, [1, 2], capture=False)], [])
        assert res[0].code == Code.OK
        rt.step([Release(2), Release(3)], [])
        assert rt.stats()["free_kv_slots"] == 2 and rt.stats()["active_sequences"] == 0
    finally:
        rt.close()


def test_full_ring_is_backpressure_and_leaves_the_sequence_untouched(tiny_target: Path) -> None:
    rt = runtime(tiny_target, max_context=128, ring_rows=128)
    try:
        res, _ = rt.step([Prefill(1, list(range(1, 101))), Prefill(2, list(range(1, 21)))], [])  # 120 rows held
        gen1, gen2 = res[0].hidden.generation, res[1].hidden.generation
        length = rt.engine.seqs[1].length
        drafts = [1, 2, 3, 4, 5, 6, 7, 8]
        res, _ = rt.step([Verify(1, drafts)], [])  # needs 9 rows: only 8 left at the tail
        assert res[0].code == Code.RESOURCE_EXHAUSTED and "ring full" in res[0].message
        assert rt.engine.seqs[1].length == length
        res, _ = rt.step([Verify(1, drafts)], [gen1])  # the draft consumed sequence 1's prefill rows
        assert res[0].code == Code.OK and res[0].hidden.offset == 0  # wrapped around
        rt.step([Release(1), Release(2)], [res[0].hidden.generation, gen2])
        assert rt.stats()["ring_rows_in_use"] == 0 and rt.stats()["ring_live_allocations"] == 0
    finally:
        rt.close()


def test_batched_verify_equals_one_sequence_at_a_time(tiny_target: Path) -> None:
    """Different lengths and different draft counts in one forward give the same tokens."""
    prompts = [[1, 2, 3], list(range(5, 30)), [7] * 9]
    drafts = [[4, 5], [], [8, 9, 10, 11]]
    alone = []
    rt = runtime(tiny_target, max_context=128, max_sequences=4)
    try:
        for i, (p, d) in enumerate(zip(prompts, drafts, strict=True)):
            (pre,), _ = rt.step([Prefill(i, p, capture=False)], [])
            (ver,), _ = rt.step([Verify(i, d, capture=False)], [])
            rt.step([Release(i)], [])
            alone.append((pre.tokens, ver.tokens))
        pres, _ = rt.step([Prefill(10 + i, p, capture=False) for i, p in enumerate(prompts)], [])
        vers, _ = rt.step([Verify(10 + i, d, capture=False) for i, d in enumerate(drafts)], [])
        assert [(p.tokens, v.tokens) for p, v in zip(pres, vers, strict=True)] == alone
    finally:
        rt.close()


def test_recapture_reproduces_the_features_of_the_sequence(tiny_target: Path) -> None:
    rt = runtime(tiny_target, max_context=128)
    try:
        (pre,), _ = rt.step([Prefill(1, [3, 1, 4, 1, 5])], [])
        (ver,), _ = rt.step([Verify(1, [9, 2, 6])], [pre.hidden.generation])
        seq = rt.engine.seqs[1]
        assert seq.length == 5 + ver.num_accepted + 1 and len(seq.tokens) == seq.length
        (rec,), _ = rt.step([Recapture(1)], [ver.hidden.generation])
        assert rec.hidden.rows == seq.length and rec.tokens == [*seq.tokens[1:], seq.last_token]
        assert rt.stats()["free_kv_slots"] == 1  # the scratch slot came back
        (nxt,), _ = rt.step([Verify(1, [])], [rec.hidden.generation])  # the sequence is untouched
        assert nxt.code == Code.OK
    finally:
        rt.close()


def test_a_verify_step_writes_its_features_into_the_ring_itself(tiny_target: Path) -> None:
    """Padded (as on a GPU), a verify step puts each row's features, its accepted path first,
    into the ring at the plan's rows itself; the host writes only the others (prefills). The
    ring then holds what the host would have written: a chain and a tree whose accepted path
    skips nodes, in one batch."""
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]]
    got = []
    for in_step in (True, False):
        rt = runtime(tiny_target, max_context=128, max_sequences=3)
        rt.engine.runner.padded = True
        if not in_step:
            rt.engine.write_ring(None)
        assert rt.writer is not None
        writes: list[int] = []
        write_all = rt.writer.write_all
        rt.writer.write_all = lambda items, w=write_all, seen=writes: seen.append(len(items)) or w(items)  # type: ignore[method-assign]
        try:
            greedy = []
            for i, p in enumerate(prompts):  # each prompt's greedy continuation, 3 tokens
                (pre,), _ = rt.step([Prefill(10 + i, p, capture=False)], [])
                tokens = list(pre.tokens)
                for _ in range(2):
                    (ver,), _ = rt.step([Verify(10 + i, [], capture=False)], [])
                    tokens += ver.tokens
                rt.step([Release(10 + i)], [])
                greedy.append(tokens)
            pres, _ = rt.step([Prefill(i, p) for i, p in enumerate(prompts)], [])
            before = len(writes)
            (c1, c2, c3), (t1, t2, t3) = greedy
            wrong = (t2 + 1) % 256
            tree = Verify(1, [wrong, t2, wrong, t3], draft_parents=[-1, -1, 0, 1])  # accepts nodes 2 and 4
            vers, _ = rt.step([Verify(0, [c2, c3, wrong]), tree], [p.hidden.generation for p in pres])
            assert [v.num_accepted for v in vers] == [2, 2]
            assert writes[before:] == ([] if in_step else [2])
            got.append([(v.tokens, rt.writer.ring[v.hidden.offset : v.hidden.offset + v.hidden.rows].clone())
                        for v in vers])
        finally:
            rt.close()
    for (tokens, rows), (host_tokens, host_rows) in zip(*got, strict=True):
        assert tokens == host_tokens and torch.equal(rows, host_rows)


def test_a_forced_tree_commits_its_path_in_the_step(tiny_target: Path) -> None:
    """Benchmark-only forced acceptance is accepted on the device like greedy acceptance: the
    ring holds the forced path's rows, written by the step as the host would write them."""
    got = []
    for in_step in (True, False):
        rt = runtime(tiny_target, max_context=128, forced_acceptance=True)
        rt.engine.runner.padded = True
        if not in_step:
            rt.engine.write_ring(None)
        assert rt.writer is not None
        try:
            (pre,), _ = rt.step([Prefill(1, [3, 1, 4, 1, 5])], [])
            tree = Verify(1, [7, 8, 9, 10], draft_parents=[-1, -1, 0, 2], forced=3)  # the path 1, 3, 4
            (ver,), _ = rt.step([tree], [pre.hidden.generation])
            assert ver.code == Code.OK and ver.num_accepted == 3
            got.append(rt.writer.ring[ver.hidden.offset : ver.hidden.offset + ver.hidden.rows].clone())
        finally:
            rt.close()
    assert torch.equal(got[0], got[1])


def test_a_newcomer_leaves_the_running_sequences_on_their_path(tiny_target: Path) -> None:
    """Padded (as on a GPU): a step that prefills a newcomer beside two running sequences'
    verifies runs the verifies padded, as a step of theirs alone would, the prompt eagerly: the
    same tokens and the same ring rows, bit for bit, as the two run one after the other."""
    prompts, newcomer = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8]], [9, 9, 8, 7]
    got = []
    for together in (True, False):
        rt = runtime(tiny_target, max_context=128, max_sequences=3)
        rt.engine.runner.padded = True
        padded_rows: list[int] = []
        run_padded = rt.engine.runner._run_padded
        rt.engine.runner._run_padded = (  # type: ignore[method-assign]
            lambda step, verify=False, f=run_padded, seen=padded_rows: seen.append(len(step.rows)) or f(step, verify))
        assert rt.writer is not None
        try:
            pres, _ = rt.step([Prefill(i, p) for i, p in enumerate(prompts)], [])
            verifies = [Verify(0, [7, 1, 1]), Verify(1, [5, 6], draft_parents=[-1, -1])]
            gens = [p.hidden.generation for p in pres]
            if together:
                out, _ = rt.step([*verifies, Prefill(2, newcomer)], gens)
            else:
                out, _ = rt.step(verifies, gens)
                out += rt.step([Prefill(2, newcomer)], [])[0]
            assert [r.code for r in out] == [Code.OK] * 3 and padded_rows == [2]
            got.append([(r.tokens, r.num_accepted, rt.writer.ring[r.hidden.offset : r.hidden.offset + r.hidden.rows]
                         .clone()) for r in out])
        finally:
            rt.close()
    for (tokens, accepted, rows), (alone_tokens, alone_accepted, alone_rows) in zip(*got, strict=True):
        assert tokens == alone_tokens and accepted == alone_accepted and torch.equal(rows, alone_rows)


def test_a_decode_of_several_tokens_equals_as_many_one_token_verifies(tiny_target: Path) -> None:
    """Verify(decode=k) gives the tokens and the state k plain decodes give, for sequences of
    different lengths side by side, one of them sampled (top-k and top-p), eagerly and padded
    (the GPU's path, here without graphs), and the sequence goes on from there as it would."""
    prompts = [[3, 1, 4, 1, 5], list(range(5, 30)), [7] * 9]
    samplings = [Sampling(), Sampling(temperature=0.9, top_p=0.9, top_k=50, seed=5), Sampling()]
    for padded in (False, True):
        got = []
        for k in (1, 4):
            rt = runtime(tiny_target, max_context=128, max_sequences=3)
            rt.engine.runner.padded = padded
            try:
                rt.step([Prefill(i, prompts[i], samplings[i], capture=False) for i in range(len(prompts))], [])
                tokens: list[list[int]] = [[] for _ in prompts]
                for _ in range(8 // k):
                    res, _ = rt.step([Verify(i, capture=False, decode=k) for i in range(len(prompts))], [])
                    assert [r.code for r in res] == [Code.OK] * 3 and all(len(r.tokens) == k for r in res)
                    for t, r in zip(tokens, res, strict=True):
                        t += r.tokens
                (after, *_), _ = rt.step([Verify(0, [5, 6], capture=False)], [])  # a verify goes on from there
                seq = rt.engine.seqs[0]
                got.append((tokens, after.tokens, seq.length, seq.tokens))
            finally:
                rt.close()
        assert got[0] == got[1], padded


def test_malformed_decodes_are_refused(tiny_target: Path) -> None:
    rt = runtime(tiny_target, max_context=16, max_sequences=2)
    try:
        res, _ = rt.step([Prefill(1, [1, 2, 3]), Prefill(2, [1, 2], Sampling(temperature=0.5), capture=False)], [])
        assert [r.code for r in res] == [Code.OK, Code.OK]
        bad = {"outside 1..17": Verify(1, capture=False, decode=0),
               "outside 1..17 ": Verify(1, capture=False, decode=18),
               "no draft tokens": Verify(1, [5], capture=False, decode=2),
               "captures no features": Verify(1, decode=2),
               "would exceed the context": Verify(1, capture=False, decode=14)}
        for why, op in bad.items():
            (r,), _ = rt.step([op], [])
            assert r.code == Code.INVALID_ARGUMENT and why.strip() in r.message, (why, r.message)
        (r,), _ = rt.step([Verify(1, capture=False, decode=13)], [])  # fills the context exactly
        assert r.code == Code.OK and len(r.tokens) == 13 and rt.engine.seqs[1].length == 16
    finally:
        rt.close()


def test_a_prompt_prefilled_in_parts_equals_it_whole(tiny_target: Path) -> None:
    """A 30-token prompt in three parts (the last beside another sequence's verify, and one
    part sampled) against the whole prompt at once: no token until the last part, then the same
    first token, the same features and KV entries, and the same greedy tokens after."""
    prompt = list(range(10, 40))
    got = []
    for parts in ([(0, 30)], [(0, 7), (7, 12), (12, 30)]):
        rt = runtime(tiny_target, max_sequences=3, hidden_backend="inline")
        try:
            rt.step([Prefill(2, [4, 5, 6])], [])
            features, tokens = [], []
            for start, end in parts:
                ops = [Prefill(1, prompt[start:end], start=start, more=end < len(prompt))]
                ops += [Verify(2, capture=False)] if end == len(prompt) else []
                res, _ = rt.step(ops, [])
                assert all(r.code == Code.OK for r in res), [r.message for r in res]
                assert res[0].hidden is not None and res[0].hidden.rows == end - start
                assert len(res[0].tokens) == (1 if end == len(prompt) else 0)
                features.append(torch.frombuffer(bytearray(res[0].hidden.inline), dtype=torch.float32))
                tokens += res[0].tokens
            for _ in range(4):
                (r,), _ = rt.step([Verify(1, capture=False)], [])
                tokens += r.tokens
            cache = rt.engine.runner.cache
            slot = rt.engine.seqs[1].slot
            got.append((tokens, torch.cat(features), cache.k[:, slot, :30].clone(), cache.v[:, slot, :30].clone()))
        finally:
            rt.close()
    (want, *whole), (tokens, *parted) = got
    assert tokens == want
    for a, b in zip(whole, parted, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_malformed_parts_of_prompts_are_refused(tiny_target: Path) -> None:
    rt = runtime(tiny_target, max_context=32, max_sequences=2)
    try:
        (r,), _ = rt.step([Prefill(1, [1, 2, 3], capture=False, more=True)], [])
        assert r.code == Code.OK and r.tokens == []
        bad = {"holds no part of a prompt of 4": Prefill(1, [4], start=4, capture=False),
               "holds no part of a prompt of 3 ": Prefill(9, [4], start=3, capture=False),
               "does not fit the context": Prefill(1, [4] * 29, start=3, capture=False),
               "has not had its whole prompt": Verify(1, capture=False),
               "has not had its whole prompt ": Recapture(1)}
        for why, op in bad.items():
            (r,), _ = rt.step([op], [])
            assert r.code == Code.INVALID_ARGUMENT and why.strip() in r.message, (why, r.message)
        (r,), _ = rt.step([Prefill(1, [4, 5], start=3, capture=False)], [])
        assert r.code == Code.OK and len(r.tokens) == 1 and rt.engine.seqs[1].length == 5
        (r,), _ = rt.step([Prefill(1, [6], start=5, capture=False)], [])  # the prompt is whole: no more parts
        assert r.code == Code.INVALID_ARGUMENT
        free = rt.engine.runner.free_slots
        rt.step([Prefill(2, [1, 2], capture=False, more=True)], [])
        rt.step([Release(2)], [])  # a sequence released halfway through its prompt gives its slot back
        assert rt.engine.runner.free_slots == free
    finally:
        rt.close()
