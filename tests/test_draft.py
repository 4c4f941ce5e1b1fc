"""The EAGLE-3 head and the draft engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_service.config import DraftConfig
from draft_service.runtime import DraftRuntime
from specsplit.checkpoints.eagle_head import load_head
from specsplit.ops import MAX_EARLIER, PUT_OFF_TOKENS, Code, ExtendPropose, HiddenRef, Release
from specsplit.transport.handoff import open_writer

SPECFORGE_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def test_random_head_is_in_specforge_format(tiny_head: Path) -> None:
    cfg, weights = load_head(tiny_head)
    assert set(weights) == SPECFORGE_KEYS
    h = cfg.hidden_size
    assert weights["fc.weight"].shape == (h, 3 * h)
    assert weights["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert weights["lm_head.weight"].shape == (cfg.draft_vocab_size, h)
    ids = torch.arange(cfg.draft_vocab_size) + weights["d2t"]
    assert torch.equal(torch.nonzero(weights["t2d"]).flatten(), ids)  # d2t and t2d agree


def make_runtime(tiny_target: Path, tiny_head: Path) -> tuple[DraftRuntime, object]:
    rt = DraftRuntime(DraftConfig(head=str(tiny_head), target=str(tiny_target), max_context=256, max_sequences=4))
    writer = open_writer("shm", 512, 3 * rt.head.cfg.target_hidden_size, torch.float32)
    rt.attach(writer.descriptor)
    return rt, writer


def put(writer, feats: torch.Tensor) -> HiddenRef:  # noqa: ANN001
    alloc = writer.allocate(feats.shape[0])
    writer.write(alloc, feats)
    return HiddenRef(alloc.offset, feats.shape[0], alloc.generation)


def test_incremental_extend_equals_one_shot_extend(tiny_target: Path, tiny_head: Path) -> None:
    """Speculative KV entries from proposals must be overwritten by the next extend."""
    rt, writer = make_runtime(tiny_target, tiny_head)
    try:
        assert rt.engine.step_path == "eagerly"  # the CPU's path
        g = torch.Generator().manual_seed(0)
        feats = torch.randn(30, writer.descriptor.width, generator=g)
        tokens = torch.randint(0, 512, (30,), generator=g).tolist()
        # sequence 1 in three extends, proposing 5 tokens in between; sequence 2 in one extend
        for lo, hi in [(0, 12), (12, 15), (15, 30)]:
            (r1,) = rt.engine.execute([ExtendPropose(1, tokens[lo:hi], put(writer, feats[lo:hi]), 5, position=lo)])
            assert r1.code == Code.OK and len(r1.draft_ids) == 5
        (r2,) = rt.engine.execute([ExtendPropose(2, tokens, put(writer, feats), 5)])
        assert r1.draft_ids == r2.draft_ids
        assert rt.engine.seqs[1].length == rt.engine.seqs[2].length == 30
        assert rt.opens == 1
    finally:
        writer.close()


def test_extends_put_off_equal_extends_in_turn(tiny_target: Path, tiny_head: Path) -> None:
    """Rows of several cycles in one ExtendPropose (`earlier` references, then `hidden`)
    give the proposals of extending them cycle by cycle; too many references are refused."""
    rt, writer = make_runtime(tiny_target, tiny_head)
    try:
        g = torch.Generator().manual_seed(1)
        feats = torch.randn(20, writer.descriptor.width, generator=g)
        tokens = torch.randint(0, 512, (20,), generator=g).tolist()
        cuts = [(0, 12), (12, 13), (13, 14), (14, 20)]
        for lo, hi in cuts:  # sequence 1: one extend a cycle, the first three extend only
            (r1,) = rt.engine.execute([ExtendPropose(1, tokens[lo:hi], put(writer, feats[lo:hi]), 4 if hi == 20 else 0,
                                                     position=lo)])
        (r2,) = rt.engine.execute([ExtendPropose(2, tokens[:12], put(writer, feats[:12]), 0)])
        refs = [put(writer, feats[lo:hi]) for lo, hi in cuts[1:]]  # sequence 2: three cycles' rows at once
        (r3,) = rt.engine.execute([ExtendPropose(2, tokens[12:], refs[-1], 4, position=12, earlier=refs[:-1])])
        assert r1.code == r2.code == r3.code == Code.OK and len(r1.draft_ids) == 4
        assert r3.draft_ids == r1.draft_ids
        many = [put(writer, feats[:1]) for _ in range(MAX_EARLIER + 1)]
        (bad,) = rt.engine.execute([ExtendPropose(3, tokens[:MAX_EARLIER + 2], put(writer, feats[:1]), 0,
                                                  earlier=many)])
        assert bad.code == Code.INVALID_ARGUMENT and "earlier" in bad.message
    finally:
        writer.close()


def test_draft_ids_are_mapped_to_target_vocabulary(tiny_target: Path, tiny_head: Path) -> None:
    rt, writer = make_runtime(tiny_target, tiny_head)
    try:
        feats = torch.randn(6, writer.descriptor.width)
        (r,) = rt.engine.execute([ExtendPropose(1, [1, 2, 3, 4, 5, 6], put(writer, feats), 6)])
        allowed = set((torch.arange(rt.head.cfg.draft_vocab_size) + rt.head.d2t).tolist())
        assert set(r.draft_ids) <= allowed
    finally:
        writer.close()


@pytest.mark.parametrize("bad", ["rows_mismatch", "too_many_steps", "bad_token", "outside_ring"])
def test_bad_extend_is_an_entry_error(tiny_target: Path, tiny_head: Path, bad: str) -> None:
    rt, writer = make_runtime(tiny_target, tiny_head)
    try:
        ref = put(writer, torch.randn(3, writer.descriptor.width))
        tokens, steps = [1, 2, 3], 2
        if bad == "outside_ring":
            ref = HiddenRef(writer.descriptor.capacity_rows - 1, 3, ref.generation)
        if bad == "rows_mismatch":
            tokens = [1, 2]
        elif bad == "too_many_steps":
            steps = 99
        else:
            tokens = [1, 2, 10**6]
        ok_ref = put(writer, torch.randn(2, writer.descriptor.width))
        results = rt.engine.execute([ExtendPropose(1, tokens, ref, steps), ExtendPropose(2, [4, 5], ok_ref, 2)])
        assert results[0].code == Code.INVALID_ARGUMENT and results[0].message
        assert results[0].consumed_generation == ref.generation
        assert results[1].code == Code.OK  # the batch goes on
        rt.engine.execute([Release(2)])
        assert rt.stats() == {"active_sequences": 0, "free_kv_slots": 4, "graphs_captured_while_serving": 0,
                              "steps_past_graph_budget": 0, "graph_capture_ms_while_serving": 0}
    finally:
        writer.close()


def test_batched_step_equals_one_sequence_at_a_time(tiny_target: Path, tiny_head: Path) -> None:
    """Different lengths and different num_steps (0 included) in one batch."""
    rt, writer = make_runtime(tiny_target, tiny_head)
    try:
        g = torch.Generator().manual_seed(3)
        width = writer.descriptor.width
        cases = [(7, 3), (2, 0), (11, 5), (4, 1)]  # (rows, num_steps)
        data = [(torch.randint(0, 512, (n,), generator=g).tolist(), torch.randn(n, width, generator=g), k)
                for n, k in cases]
        alone = []
        for i, (t, f, k) in enumerate(data):
            alone.append(rt.engine.execute([ExtendPropose(10 + i, t, put(writer, f), k)])[0].draft_ids)
            rt.engine.execute([Release(10 + i)])
        together = rt.engine.execute([ExtendPropose(20 + i, t, put(writer, f), k) for i, (t, f, k) in enumerate(data)])
        assert all(r.code == Code.OK for r in together)
        assert [r.draft_ids for r in together] == alone
        assert [len(a) for a in alone] == [k for _, k in cases]
    finally:
        writer.close()


@pytest.mark.parametrize("padded", [False, True])
def test_the_draft_gathers_its_features_from_the_ring(tiny_target: Path, tiny_head: Path, padded: bool) -> None:
    """Where the ring sits on the draft's device the step reads each entry's features from it
    in place (eagerly, or inside the padded cycle's function): the same proposals as reading
    them first, for a batch of chains and trees over several cycles, an earlier reference too."""
    g = torch.Generator().manual_seed(5)
    runs = []
    for gather in (True, False):
        rt, writer = make_runtime(tiny_target, tiny_head)
        rt.engine.runner.padded = padded
        reader, reads = rt.engine.reader, []
        assert reader is not None
        if not gather:
            reader.ring_on = lambda device: None  # type: ignore[method-assign]
        read = reader.read
        reader.read = lambda *a, read=read, reads=reads: reads.append(a) or read(*a)  # type: ignore[method-assign]
        g.manual_seed(5)
        width, out = writer.descriptor.width, []
        try:
            position = [0, 0, 0]
            for cycle in range(3):
                ops = []
                for i, (topk, tree) in enumerate([(1, 0), (4, 8), (1, 0)]):
                    n = 6 if cycle == 0 else 1 + i + cycle
                    tokens = torch.randint(0, 512, (n,), generator=g).tolist()
                    feats = torch.randn(n, width, generator=g)
                    earlier = [put(writer, feats[:1])] if i == 2 and cycle else []
                    ref = put(writer, feats[len(earlier):])
                    ops.append(ExtendPropose(i, tokens, ref, 3, position=position[i], topk=topk,
                                             num_draft_tokens=tree, earlier=earlier))
                    position[i] += n
                results = rt.engine.execute(ops)
                assert all(r.code == Code.OK for r in results), [r.message for r in results]
                out.append([(r.draft_ids, r.draft_parents) for r in results])
            assert bool(reads) != gather  # gathering, nothing is read ahead of the step
        finally:
            writer.close()
        runs.append(out)
    assert runs[0] == runs[1]


def test_extend_position_must_match_or_restart(tiny_target: Path, tiny_head: Path) -> None:
    rt, writer = make_runtime(tiny_target, tiny_head)
    try:
        w = writer.descriptor.width
        (r,) = rt.engine.execute([ExtendPropose(1, [1, 2, 3], put(writer, torch.randn(3, w)), 2)])
        first = r.draft_ids
        (r,) = rt.engine.execute([ExtendPropose(1, [4], put(writer, torch.randn(1, w)), 2, position=7)])
        assert r.code == Code.INVALID_ARGUMENT and "position 3" in r.message
        torch.manual_seed(0)
        feats = torch.randn(3, w)
        (a,) = rt.engine.execute([ExtendPropose(2, [1, 2, 3], put(writer, feats), 3)])
        (b,) = rt.engine.execute([ExtendPropose(2, [1, 2, 3], put(writer, feats), 3, position=0)])  # restart
        assert a.draft_ids == b.draft_ids and rt.engine.seqs[2].length == 3 and len(first) == 2
    finally:
        writer.close()


@pytest.mark.parametrize("option", [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_output": True},
                                    {"eagle_config": {"use_aux_norm": True}},
                                    {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}])
def test_head_options_specsplit_cannot_honour_are_refused(tiny_head: Path, tmp_path: Path, option: dict) -> None:
    import json
    import shutil

    head = tmp_path / "head"
    shutil.copytree(tiny_head, head)
    cfg = json.loads((head / "config.json").read_text())
    for key, value in option.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    (head / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported|takes 3"):
        load_head(head)


def test_a_shipped_embedding_is_replaced_by_the_targets(tiny_target: Path, tiny_head: Path, tmp_path: Path) -> None:
    """As in SGLang's EAGLE worker: the head drafts with the target's token embedding."""
    import shutil

    from safetensors.torch import load_file, save_file

    from specsplit.checkpoints.target_checkpoint import load_safetensors_dir

    head = tmp_path / "head"
    shutil.copytree(tiny_head, head)
    weights = load_file(head / "model.safetensors")
    weights["embed_tokens.weight"] = torch.randn(512, 64)
    save_file(weights, head / "model.safetensors")
    rt = DraftRuntime(DraftConfig(head=str(head), target=str(tiny_target), max_context=64, max_sequences=1))
    target_embed = load_safetensors_dir(tiny_target)["model.embed_tokens.weight"]
    assert torch.equal(rt.head.embed_tokens.weight, target_embed)


def test_extends_put_off_run_padded_as_they_run_eagerly(tiny_target: Path, tiny_head: Path) -> None:
    """An extend of the tokens put off (up to PUT_OFF_TOKENS) runs padded to its extend bucket
    (from a graph on CUDA), like a cycle's: the draft state and proposals equal the eager path's."""
    runs = []
    for padded in (False, True):
        rt, writer = make_runtime(tiny_target, tiny_head)
        runner = rt.engine.runner
        runner.padded, padded_steps = padded, []
        run_padded = runner._run_padded
        runner._run_padded = lambda step, verify=False, run=run_padded, seen=padded_steps: (  # type: ignore[method-assign]
            seen.append(step) or run(step, verify))
        try:
            g = torch.Generator().manual_seed(3)
            feats = torch.randn(60, writer.descriptor.width, generator=g)
            tokens = torch.randint(0, 512, (60,), generator=g).tolist()
            out = []
            for lo, hi, steps in [(0, 12, 0), (12, 12 + PUT_OFF_TOKENS, 0), (44, 45, 4), (45, 60, 3)]:
                refs = [put(writer, feats[i : i + 1]) for i in range(lo, hi)]  # a reference a cycle
                (r,) = rt.engine.execute([ExtendPropose(1, tokens[lo:hi], refs[-1], steps, position=lo,
                                                        earlier=refs[:-1])])
                assert r.code == Code.OK, r.message
                out.append(r.draft_ids)
            runs.append(out)
            if padded:  # the extend of 32 tokens, and the one of 15 padded to 16 (the proposals grow on their own)
                assert [max(len(r.tokens) for r in st.rows) for st in padded_steps] == [PUT_OFF_TOKENS, 15]
        finally:
            writer.close()
    assert runs[0] == runs[1] and [len(x) for x in runs[0]] == [0, 0, 4, 3]
