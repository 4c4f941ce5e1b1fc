"""`specsplit train-head`, end to end: load the target, generate its responses, choose the
draft vocabulary, train the head under the budget, write it in the SGLang / SpecForge
format, check that the draft service's loader reads it, and write the log and the plot."""

from __future__ import annotations

import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

from specsplit.checkpoints.eagle_head import load_head, save_head
from specsplit.checkpoints.target_checkpoint import resolve_target_dir
from specsplit.models.batch import Batch
from specsplit.models.eagle3 import Eagle3Head
from specsplit.tokenizer import TextCodec
from specsplit.training import prompts as prompt_set
from specsplit.training import resume
from specsplit.training.config import TrainConfig
from specsplit.training.distill import Sample, generate_all
from specsplit.training.loop import Trainer
from specsplit.training.model import TrainableHead, head_config
from specsplit.training.progress import Progress
from specsplit.training.report import plot, write_log
from specsplit.training.self_instruct import synthesize
from specsplit.training.target import BatchedTarget
from specsplit.training.vocab import DraftVocab, build_vocab, count_response_tokens


def say(msg: str) -> None:
    print(f"[train-head] {msg}", file=sys.stderr, flush=True)


def head_bytes(head: TrainableHead, vocab: DraftVocab, dtype: torch.dtype) -> int:
    params = sum(p.numel() for p in head.parameters())
    return params * torch.empty((), dtype=dtype).element_size() + vocab.d2t.numel() * 8 + vocab.t2d.numel()


def save(out: Path, head: TrainableHead, vocab: DraftVocab, cfg: TrainConfig, trainer: Trainer | None = None) -> None:
    """The head as a checkpoint, and for a resumable run the trainer's state."""
    if cfg.resume and trainer is not None and trainer.position:
        resume.save_state(out, trainer.state())
    save_head(out, head.cfg, head.export(vocab, cfg_dtype(cfg.save_dtype)))
    hf = json.loads((out / "config.json").read_text())
    hf["torch_dtype"] = cfg.save_dtype
    (out / "config.json").write_text(json.dumps(hf, indent=1))


def cfg_dtype(name: str) -> torch.dtype:
    from specsplit.transport.handoff.base import DTYPES

    return DTYPES[name]


@torch.no_grad()
def inference_check(out: Path, head: TrainableHead, target: BatchedTarget, sample: Sample) -> dict:
    """Load the written head as the draft service does and compare step-0 argmaxes with the
    training module on one sequence (fp32 on the CPU; the saved weights are rounded)."""
    hcfg, weights = load_head(out)
    inf = Eagle3Head(hcfg)
    inf.load_weights(weights, target.embed.float().cpu())
    inf.eval()
    ids = sample.ids[None].to(target.device)
    aux, _ = target.features(ids)
    n = ids.shape[1] - 1
    feats, toks = aux[0, :n].float().cpu(), sample.ids[1:]
    logits_inf, _ = inf(toks, Batch.sequence(toks, hidden=feats), inf.new_cache(1, n + 1))
    head_cpu = TrainableHead(head.cfg, target.embed.float().cpu())
    head_cpu.load_state_dict({k: v.float().cpu() for k, v in head.state_dict().items()})
    logits_train = next(head_cpu.unroll(feats[None], toks[None], 1))[0]
    agree = (logits_inf.argmax(-1) == logits_train.argmax(-1)).float().mean().item()
    return {"positions": n, "step0_argmax_agreement": round(agree, 4),
            "max_abs_logit_diff": round((logits_inf - logits_train).abs().max().item(), 4)}


def self_instructed(cfg: TrainConfig, target: BatchedTarget, codec: TextCodec | None, t_start: float,
                    log: dict) -> list[dict]:
    """Requests the target writes itself, as prompt records; at most a quarter of the generation window."""
    if codec is None:
        raise ValueError("self_instruct needs the target's tokenizer and chat template")
    deadline = t_start + 0.25 * cfg.gen_fraction * cfg.time_budget if cfg.time_budget else None
    bar = Progress("self-instruct", cfg.self_instruct)
    texts, st = synthesize(target, codec, cfg.self_instruct, cfg.self_instruct_max_tokens, cfg.gen_batch_size,
                           cfg.self_instruct_temperature, cfg.seed + 1, deadline,
                           lambda done, total, s: bar.update(done, f"{s.new_tokens_per_s():.0f} new tok/s"))
    bar.close(st.prompts, f"{len(texts)} distinct requests kept of {st.prompts} written in {st.seconds:.1f} s")
    log["self_instruct"] = {**st.as_dict(), "kept": len(texts), "examples": [t[:200] for t in texts[:5]]}
    return [{"text": t, "split": "train", "kind": "self_instruct", "raw": False} for t in texts]


def generate_data(cfg: TrainConfig, target: BatchedTarget, codec: TextCodec | None, t_start: float, log: dict
                  ) -> tuple[list[Sample], list[Sample], DraftVocab]:
    """The target's responses to the prompts, split into train and held-out, and the draft vocabulary."""
    tcfg = target.cfg
    records = prompt_set.select(prompt_set.load_records(cfg.prompts), "train", cfg.num_prompts, cfg.seed)
    gen_deadline = t_start + cfg.gen_fraction * cfg.time_budget if cfg.time_budget else None
    if cfg.self_instruct:
        records += self_instructed(cfg, target, codec, t_start, log)
        random.Random(cfg.seed).shuffle(records)  # a deadline then drops a tail of both kinds alike
    prompt_ids = prompt_set.encode(records, codec, tcfg.vocab_size, cfg.max_prompt_tokens)
    bar = Progress("generate", len(prompt_ids))
    say(f"generating up to {cfg.max_new_tokens} tokens for {len(prompt_ids)} prompts, batch {cfg.gen_batch_size}")
    samples, gstats = generate_all(
        target, prompt_ids, cfg.max_new_tokens, cfg.gen_batch_size, tcfg.eos_token_ids, cfg.temperature, cfg.seed,
        gen_deadline, lambda done, total, s: bar.update(done, f"{s.new_tokens_per_s():.0f} new tok/s"))
    bar.close(gstats.prompts, f"{gstats.new_tokens} new tokens in {gstats.seconds:.1f} s")
    log["generation"] = gstats.as_dict()
    if codec is not None:
        log["generation"]["examples"] = [codec.decode(s.ids[s.prompt_len:].tolist())[:400] for s in samples[:3]]
    if len(samples) < 2:
        raise RuntimeError(f"only {len(samples)} responses were generated: raise the budget or lower the batch")

    random.Random(cfg.seed).shuffle(samples)
    n_val = min(max(1, round(len(samples) * cfg.val_fraction)), len(samples) - 1) if cfg.val_fraction else 0
    val, train = samples[:n_val], samples[n_val:]
    vocab = build_vocab(count_response_tokens(train, tcfg.vocab_size), min(cfg.draft_vocab, tcfg.vocab_size))
    say(f"draft vocabulary {vocab.size} tokens: {100 * vocab.coverage:.2f}% of the response tokens; "
        f"{len(train)} train / {len(val)} held-out sequences")
    return train, val, vocab


def run(cfg: TrainConfig) -> dict:
    cfg.validate()
    t_start = time.monotonic()
    deadline = t_start + cfg.time_budget if cfg.time_budget else None
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(cfg.device)
    log: dict = {"config": cfg.as_dict(), "env": {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads()}}

    model_dir = resolve_target_dir(cfg.target)
    target = BatchedTarget.load(str(model_dir), dev, cfg.torch_dtype, cfg.aux_layer_ids)
    codec = TextCodec.from_checkpoint(model_dir)
    tcfg = target.cfg
    log["target"] = {"name": tcfg.name, "dir": str(model_dir), "layers": tcfg.num_layers, "hidden": tcfg.hidden_size,
                     "vocab": tcfg.vocab_size, "aux_layer_ids": target.aux_layer_ids, "eos": tcfg.eos_token_ids,
                     "tokenizer": codec is not None}
    say(f"target {tcfg.name}: {tcfg.num_layers} layers, hidden {tcfg.hidden_size}, vocab {tcfg.vocab_size}, "
        f"{cfg.dtype} on {dev} (loaded in {time.monotonic() - t_start:.1f} s)")

    saved = resume.load_data(out, cfg) if cfg.resume else None
    if saved is not None:
        train, val, vocab, log["generation"] = saved
        say(f"resuming the run in {out}: {len(train)} train / {len(val)} held-out sequences")
    else:
        train, val, vocab = generate_data(cfg, target, codec, t_start, log)
        if cfg.resume:
            resume.save_data(out, cfg, train, val, vocab, log["generation"])
    log["vocab"] = {"size": vocab.size, "coverage": round(vocab.coverage, 5)}

    head = TrainableHead(head_config(tcfg, vocab.size, target.aux_layer_ids, cfg.name), target.embed).to(dev)
    head.init_from_target(target.lm_head, target.norm, vocab)
    size = head_bytes(head, vocab, cfg_dtype(cfg.save_dtype))
    if cfg.max_head_mb and size > cfg.max_head_mb * 1e6:
        raise ValueError(f"the head would take {size / 1e6:.1f} MB > max_head_mb {cfg.max_head_mb}: "
                         "lower draft_vocab or save in bfloat16")
    trainer = Trainer(cfg, target, head, vocab)
    state = resume.load_state(out) if cfg.resume else None
    if state is not None:
        trainer.restore(state)
        say(f"resuming at step {state['step']}")
    reserve = max(10.0, 0.03 * cfg.time_budget)  # saving, the load check, the plot
    say(f"training {sum(p.numel() for p in head.parameters()) / 1e6:.2f} M parameters, TTT length {cfg.ttt_length}"
        + (f", {deadline - reserve - time.monotonic():.0f} s left for it" if deadline else ""))
    try:
        train_deadline = deadline - reserve if deadline else None
        history = trainer.train(train, val, train_deadline, lambda: save(out, head, vocab, cfg, trainer))
    except KeyboardInterrupt:
        history = trainer.history
        history["stop"] = "interrupt"
        say("interrupted: saving what was trained")

    save(out, head, vocab, cfg, trainer)
    log["head"] = {"dir": str(out), "bytes": (out / "model.safetensors").stat().st_size, "dtype": cfg.save_dtype,
                   "inference_check": inference_check(out, head, target, val[0] if val else train[0])}
    log["training"] = {k: v for k, v in history.items() if k not in ("train", "val")}
    log["history"] = {"train": history["train"], "val": history["val"]}
    log["final"] = history["val"][-1] if history["val"] else (history["train"][-1] if history["train"] else {})
    log["seconds_total"] = round(time.monotonic() - t_start, 2)
    write_log(out / "train_log.json", log)
    plotted = plot(log, out / "train_curves.png")
    summary = {"head": str(out), "head_mb": round(log["head"]["bytes"] / 1e6, 2), "generation": log["generation"],
               "training": log["training"], "final": log["final"], "vocab": log["vocab"],
               "inference_check": log["head"]["inference_check"], "plot": plotted,
               "seconds_total": log["seconds_total"]}
    summary["generation"] = {k: v for k, v in summary["generation"].items() if k != "examples"}
    print(json.dumps(summary), flush=True)
    return log
