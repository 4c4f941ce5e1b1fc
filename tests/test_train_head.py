"""`specsplit train-head` end to end on a tiny CPU target: loss falls, acceptance rises, the
head is written in the SGLang / SpecForge format, loads in the draft engine and speeds up
(losslessly) the in-process loop; the time budget stops it cleanly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_service.config import DraftConfig
from gateway.local import LocalEngines
from gateway.scheduler import GenerationRequest
from specsplit.checkpoints.tiny import tiny_config, write_tiny_target
from specsplit.cli.main import main as cli_main
from specsplit.ops import Sampling
from specsplit.training.config import TrainConfig
from specsplit.training.loop import Trainer
from specsplit.training.pipeline import run
from specsplit.training.prompts import encode, load_records, select
from target_service.config import TargetConfig


@pytest.fixture
def one_thread() -> Iterator[None]:
    """This 2-core machine is shared: one intra-op thread is several times faster here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny target whose next token depends on the current token only (attention and MLP
    outputs zeroed), so a head can learn it in seconds. A fully random target cannot be
    learned by a one-layer head in that time: its acceptance says nothing about the code."""
    out = write_tiny_target(tmp_path_factory.mktemp("bigram") / "target", tiny_config(), seed=1, std=0.5)
    w = load_file(out / "model.safetensors")
    save_file({k: v * 0 if k.endswith(("o_proj.weight", "down_proj.weight")) else v for k, v in w.items()},
              out / "model.safetensors")
    return out


def test_train_head_learns_and_the_head_serves(bigram_target: Path, tmp_path: Path, one_thread: None) -> None:
    out = tmp_path / "head"
    log = run(TrainConfig(out=str(out), target=str(bigram_target), num_prompts=96, max_new_tokens=40,
                          gen_batch_size=96, max_steps=40, batch_size=16, draft_vocab=256, ttt_length=3, lr=3e-3,
                          log_every=10, eval_every=0, val_fraction=0.1, save_every_s=0))
    train = log["history"]["train"]
    assert train[-1]["loss"] < 0.6 * train[0]["loss"]
    final = log["final"]  # held-out sequences
    assert final["acc_k"][0] > 0.6 and final["acc_k"][0] > train[0]["acc_k"][0] + 0.4
    assert final["tau_est"] > 2.0
    assert log["head"]["inference_check"]["step0_argmax_agreement"] > 0.95
    for name in ("config.json", "model.safetensors", "train_log.json", "train_curves.png"):
        assert (out / name).exists(), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 256
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == log["target"]["aux_layer_ids"]
    assert log["generation"]["new_tokens_per_s"] > 0 and log["training"]["tokens_per_s"] > 0

    engines = LocalEngines(TargetConfig(model=str(bigram_target), max_context=256,
                                        draft_config=str(out / "config.json")),
                           DraftConfig(head=str(out), target=str(bigram_target), max_context=256))
    try:
        # held-out prompts, encoded as training encodes them for a target without a tokenizer
        prompts = encode(select(load_records(), "heldout", 4, 0), None, 512, 64)
        base = engines.generate([GenerationRequest(p, 24, Sampling(), {511}, 0) for p in prompts])
        spec = engines.generate([GenerationRequest(p, 24, Sampling(), {511}, 3) for p in prompts])
    finally:
        engines.close()
    assert [s.tokens for s in spec] == [b.tokens for b in base]  # lossless
    cycles = sum(s.stats.cycles for s in spec)
    emitted = sum(k * v for s in spec for k, v in s.stats.histogram.items())
    assert emitted / cycles > 2.0  # the trained head is accepted in the real loop


def test_time_budget_stops_and_saves(bigram_target: Path, tmp_path: Path, one_thread: None) -> None:
    out = tmp_path / "budget"
    rc = cli_main(["train-head", "--target", str(bigram_target), "--out", str(out), "--num-prompts", "64",
                   "--max-new-tokens", "24", "--draft-vocab", "128", "--ttt-length", "2", "--batch-size", "8",
                   "--time-budget", "20", "--eval-every", "0"])
    assert rc == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["training"]["stop"] == "time" and log["training"]["steps"] > 0
    assert log["seconds_total"] < 20 + 5
    assert (out / "model.safetensors").exists()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="limit"):
        TrainConfig(out="x").validate()  # no steps, epochs or time budget
    with pytest.raises(ValueError, match="dtype"):
        TrainConfig(out="x", max_steps=1, dtype="int8").validate()
    with pytest.raises(ValueError, match="gen_fraction"):
        TrainConfig(out="x", max_steps=1, gen_fraction=1.5).validate()
    cfg = TrainConfig(out="x", max_steps=1, device="cpu").validate()
    assert cfg.dtype == "float32"


def test_feature_cache_gives_the_same_losses(bigram_target: Path, one_thread: None) -> None:
    """Features read from the cache (built once, in other batches) equal the target's online ones."""
    import random

    from specsplit.training.distill import Sample
    from specsplit.training.feature_cache import FeatureCache, choose_store
    from specsplit.training.loop import Trainer, collate, make_batches
    from specsplit.training.model import TrainableHead, head_config
    from specsplit.training.target import BatchedTarget
    from specsplit.training.vocab import build_vocab, count_response_tokens

    target = BatchedTarget.load(str(bigram_target), "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(8, 40, (24,), generator=g).tolist()
    samples = [Sample(torch.randint(0, 512, (n,), generator=g), 5) for n in sizes]
    cfg = TrainConfig(out="unused", target=str(bigram_target), max_steps=1, ttt_length=3, draft_vocab=128,
                      batch_size=5).validate()
    vocab = build_vocab(count_response_tokens(samples, 512), 128)
    head = TrainableHead(head_config(target.cfg, vocab.size, target.aux_layer_ids, "t"), target.embed)
    trainer = Trainer(cfg, target, head, vocab)
    lengths = [len(s.ids) for s in samples]
    store = choose_store("auto", target, FeatureCache.nbytes(samples, target))
    assert store == torch.device("cpu")
    cache = FeatureCache.build(target, samples, store, make_batches(lengths, 7, 4096, random.Random(1)), collate)
    assert cache is not None and cache.aux.shape == (sum(lengths) + 1, 3 * target.cfg.hidden_size)
    for idx in make_batches(lengths, 5, 4096, random.Random(2)):  # other batch compositions than the cache's
        batch = collate([samples[i] for i in idx], torch.device("cpu"))
        trainer.cache = None
        online_loss, online_vec = trainer.forward(batch, idx)
        trainer.cache = cache
        cached_loss, cached_vec = trainer.forward(batch, idx)
        torch.testing.assert_close(cached_loss, online_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cached_vec, online_vec, rtol=1e-5, atol=1e-5)
    assert FeatureCache.build(target, samples, store, [[0]], collate, deadline=0.0) is None  # past the deadline
    with pytest.raises(ValueError, match="CUDA"):
        choose_store("gpu", target, 1)
    assert choose_store("off", target, 1) is None


def test_a_run_resumed_after_an_interrupt_trains_what_one_run_trains(bigram_target: Path, tmp_path: Path,
                                                                     one_thread: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    settings = {"target": str(bigram_target), "num_prompts": 32, "max_new_tokens": 24, "draft_vocab": 128,
                "ttt_length": 2, "batch_size": 8, "max_steps": 12, "eval_every": 0, "save_every_s": 0.0,
                "save_dtype": "float32", "resume": True}
    run(TrainConfig(out=str(tmp_path / "whole"), **settings))

    steps = 0
    forward = Trainer.forward

    def stopped_at_step_6(self: Trainer, batch: object, idx: list[int] | None = None) -> object:
        nonlocal steps
        if idx is not None:  # a training step (evaluation passes no indices)
            steps += 1
            if steps == 6:
                raise KeyboardInterrupt  # as a command stopped mid-run
        return forward(self, batch, idx)

    monkeypatch.setattr(Trainer, "forward", stopped_at_step_6)
    first = run(TrainConfig(out=str(tmp_path / "split"), **settings))
    assert first["training"]["stop"] == "interrupt"
    monkeypatch.undo()
    with pytest.raises(ValueError, match="lr 0.0006 -> 0.001"):
        run(TrainConfig(out=str(tmp_path / "split"), **{**settings, "lr": 1e-3}))
    second = run(TrainConfig(out=str(tmp_path / "split"), **settings))
    assert second["training"]["stop"] == "steps" and second["training"]["steps"] == 12
    assert second["generation"] == first["generation"]  # the saved responses, not generated again
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    split = load_file(tmp_path / "split" / "model.safetensors")
    assert whole.keys() == split.keys()
    for name in whole:
        assert torch.equal(whole[name], split[name]), name
