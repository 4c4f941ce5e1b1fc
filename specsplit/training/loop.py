"""The optimisation loop: length-bucketed batches, the frozen target's features and logits
computed online for every batch, the head unrolled over the TTT steps, AdamW with warmup
and a cosine decay driven by whichever limit (steps, epochs, time) comes first."""

from __future__ import annotations

import gc
import math
import random
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from specsplit.training.config import TrainConfig
from specsplit.training.distill import Sample
from specsplit.training.feature_cache import FeatureCache, choose_store
from specsplit.training.model import TrainableHead
from specsplit.training.objective import Batch, make_targets, step_loss
from specsplit.training.progress import Progress
from specsplit.training.target import BatchedTarget
from specsplit.training.vocab import DraftVocab


def make_batches(lengths: list[int], batch_size: int, batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Index lists of similar-length sequences, each within batch_size and batch_tokens
    (padded); shuffled. A sequence longer than batch_tokens gets a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:  # ascending: the newest member is the longest
        if cur and (len(cur) >= batch_size or (len(cur) + 1) * lengths[i] > batch_tokens):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(samples: list[Sample], device: torch.device) -> Batch:
    lengths = [len(s.ids) for s in samples]
    tokens = torch.zeros(len(samples), max(lengths), dtype=torch.long)
    for i, s in enumerate(samples):
        tokens[i, : len(s.ids)] = s.ids
    return Batch(tokens.to(device), torch.tensor(lengths, device=device),
                 torch.tensor([s.prompt_len for s in samples], device=device))


class Stats:
    """Running sums of per-step figures, kept on the device (one host sync per report)."""

    def __init__(self, steps: int) -> None:
        self.k = steps
        self.sums: torch.Tensor | None = None
        self.batches, self.tokens = 0, 0

    def add(self, vec: torch.Tensor, tokens: int) -> None:
        self.sums = vec if self.sums is None else self.sums + vec
        self.batches += 1
        self.tokens += tokens

    def summary(self) -> dict:
        if self.sums is None:
            return {}
        v, k, n = self.sums.tolist(), self.k, self.batches
        loss_k = [x / n for x in v[:k]]
        correct, counted, chain, chain_den = v[k:2 * k], v[2 * k:3 * k], v[3 * k:4 * k], max(v[4 * k], 1.0)
        chain_k = [c / chain_den for c in chain]
        return {"loss": round(v[4 * k + 1] / n, 5), "loss_k": [round(x, 5) for x in loss_k],
                "acc_k": [round(c / max(d, 1.0), 5) for c, d in zip(correct, counted, strict=True)],
                "chain_k": [round(c, 5) for c in chain_k], "tau_est": round(1 + sum(chain_k), 4),
                "positions": int(counted[0])}


class Trainer:
    def __init__(self, cfg: TrainConfig, target: BatchedTarget, head: TrainableHead, vocab: DraftVocab) -> None:
        self.cfg, self.target, self.head, self.vocab = cfg, target, head, vocab
        self.device = target.device
        self.draft_ids, self.t2d = vocab.ids.to(self.device), vocab.t2d.to(self.device)
        self.opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.autocast_on = target.dtype != torch.float32  # bf16 / fp16 matmuls, fp32 master weights
        self.cache: FeatureCache | None = None  # the training sequences' target features, once built
        self.position: dict = {}  # where training stands: batches, next batch, step, rng (see state)

    def _autocast(self):  # noqa: ANN202
        return torch.autocast(self.device.type, dtype=self.target.dtype) if self.autocast_on else nullcontext()

    def forward(self, batch: Batch, idx: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> weighted loss (differentiable), stats vector [4K + 2] (see Stats). `idx`: the
        batch's training-sequence indices, to read their features from the cache."""
        k_steps, x = self.cfg.ttt_length, batch.tokens
        n = x.shape[1] - 1
        if self.cache is not None and idx is not None:
            aux, normed = self.cache.gather(idx, x.shape[1], self.device)
        else:
            aux, normed = self.target.features(x)  # [B, T, 3H], [B, T, H]
        with torch.no_grad():
            targets = make_targets(self.target.logits(normed), self.draft_ids, self.t2d)
        feats = aux[:, :n].clone()  # out of inference mode: autograd may save it
        inputs = F.pad(x[:, 1:], (0, k_steps - 1))  # [B, N + K - 1]: inputs[:, j] = x[j + 1]
        total = torch.zeros((), device=self.device)
        losses, correct, counted = [], [], []
        with self._autocast():
            for k, logits in enumerate(self.head.unroll(feats, inputs, k_steps)):
                r = step_loss(logits, targets, batch, k)
                total = total + self.cfg.step_weight ** k * r.loss
                losses.append(r.loss.detach().float())
                correct.append(r.correct)
                counted.append(r.counted)
        corr, cnt = torch.stack(correct), torch.stack(counted)  # [K, B, N]
        full = cnt.all(0)  # positions scored at every step: the chained acceptance's population
        chain = (corr.cumprod(0).bool() & full).flatten(1).sum(-1)
        vec = torch.cat([torch.stack(losses), corr.flatten(1).sum(-1).float(), cnt.flatten(1).sum(-1).float(),
                         chain.float(), full.sum().float()[None], total.detach().float()[None]])
        return total, vec

    def _build_cache(self, train: list[Sample], lengths: list[int], deadline: float | None) -> FeatureCache | None:
        nbytes = FeatureCache.nbytes(train, self.target)
        if self.target.device.type == "cuda":  # generation's KV cache is garbage now: give it back before sizing
            gc.collect()
            torch.cuda.empty_cache()
        store = choose_store(self.cfg.feature_cache, self.target, nbytes)
        if store is None:
            if self.cfg.feature_cache != "off":
                print(f"[train-head] feature cache: {nbytes / 1e9:.1f} GB would not fit; "
                      "the target runs for every batch", file=sys.stderr, flush=True)
            return None
        bar = Progress("features", len(train))
        t0 = time.monotonic()
        batches = make_batches(lengths, self.cfg.batch_size, self.cfg.batch_tokens, random.Random(0))
        cache = FeatureCache.build(self.target, train, store, batches, collate, deadline,
                                   lambda done, total: bar.update(done, f"{nbytes / 1e9:.1f} GB on {store}"))
        bar.close(len(train) if cache else 0, f"cached in {time.monotonic() - t0:.1f} s" if cache else
                  "deadline reached: no cache")
        return cache

    def lr_at(self, step: int, progress: float) -> float:
        warm = min(1.0, (step + 1) / self.cfg.warmup_steps) if self.cfg.warmup_steps else 1.0
        r = self.cfg.min_lr_ratio
        return self.cfg.lr * warm * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    @torch.no_grad()
    def evaluate(self, samples: list[Sample]) -> dict:
        if not samples:
            return {}
        self.head.eval()
        stats = Stats(self.cfg.ttt_length)
        for idx in make_batches([len(s.ids) for s in samples], self.cfg.batch_size, self.cfg.batch_tokens,
                                random.Random(0)):
            _, vec = self.forward(collate([samples[i] for i in idx], self.device))
            stats.add(vec, 0)
        self.head.train()
        return stats.summary()

    def state(self) -> dict:
        """What a later command needs to go on with this run (train-head --resume)."""
        return {"head": self.head.state_dict(), "opt": self.opt.state_dict(), **self.position}

    def restore(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["opt"])
        self.position = {k: v for k, v in state.items() if k not in ("head", "opt")}

    def train(self, train: list[Sample], val: list[Sample], deadline: float | None,
              save: Callable[[], None] | None = None) -> dict:
        """Train until the step / epoch limit or `deadline` (time.monotonic()), from the position
        `restore` set if any; returns the history (of every command of the run)."""
        cfg = self.cfg
        lengths = [len(s.ids) for s in train]
        self.cache = self._build_cache(train, lengths, deadline)
        pos = self.position
        if pos:  # a resumed run: the same batches from where it stopped
            rng = random.Random()
            rng.setstate(pos["rng"])
            epoch_batches, epoch, first, step, tokens_total = (pos["batches"], pos["epoch"], pos["next_batch"],
                                                               pos["step"], pos["tokens"])
            history = pos["history"]
            history["stop"] = ""
        else:
            rng = random.Random(cfg.seed)
            epoch_batches = make_batches(lengths, cfg.batch_size, cfg.batch_tokens, rng)
            epoch, first, step, tokens_total = 0, 0, 0, 0
            history = {"train": [], "val": [], "steps_per_epoch": len(epoch_batches), "stop": ""}
        limits = [cfg.max_steps] if cfg.max_steps else []
        if cfg.epochs:
            limits.append(max(1, round(cfg.epochs * len(epoch_batches))))
        max_steps = min(limits) if limits else None
        t0, tokens0 = time.monotonic(), tokens_total  # this command's start
        span = (deadline - t0) if deadline is not None and not cfg.resume else None  # resumable: by steps only
        self.history = history  # readable after an interrupt
        bar = Progress("train", max_steps)
        stats, last_save, step_time, lr = Stats(cfg.ttt_length), t0, 0.0, cfg.lr
        self.head.train()
        while True:
            for bi in range(first, len(epoch_batches)):
                idx = epoch_batches[bi]
                now = time.monotonic()
                if max_steps is not None and step >= max_steps:
                    history["stop"] = "steps"
                elif deadline is not None and now + 1.5 * step_time > deadline:
                    history["stop"] = "time"
                if history["stop"]:
                    break
                progress = max(step / max_steps if max_steps else 0.0, (now - t0) / span if span else 0.0)
                lr = self.lr_at(step, progress)
                for group in self.opt.param_groups:
                    group["lr"] = lr
                batch = collate([train[i] for i in idx], self.device)
                loss, vec = self.forward(batch, idx)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.head.parameters(), cfg.grad_clip)
                self.opt.step()
                tokens = int(sum(lengths[i] for i in idx))
                stats.add(vec, tokens)
                tokens_total += tokens
                step += 1
                self.position = {"rng": rng.getstate(), "batches": epoch_batches, "epoch": epoch,
                                 "next_batch": bi + 1, "step": step, "tokens": tokens_total, "history": history}
                step_time = 0.8 * step_time + 0.2 * (time.monotonic() - now) if step > 1 else time.monotonic() - now
                if step % cfg.log_every == 0:
                    at = epoch + (bi + 1) / len(epoch_batches)
                    rec = self._record(stats, step, at, lr, t0, tokens_total - tokens0)
                    history["train"].append(rec)
                    stats = Stats(cfg.ttt_length)
                    eta = (deadline - time.monotonic()) if deadline is not None and max_steps is None else None
                    bar.update(step, f"epoch {rec['epoch']:.2f} | loss {rec['loss']:.3f} | acc "
                                     + " ".join(f"{a:.2f}" for a in rec["acc_k"])
                                     + f" | tau~{rec['tau_est']:.2f} | {rec['tokens_per_s']:.0f} tok/s", eta_s=eta)
                if cfg.eval_every and step % cfg.eval_every == 0 and val:
                    history["val"].append({"step": step, **self.evaluate(val)})
                if save is not None and cfg.save_every_s and time.monotonic() - last_save > cfg.save_every_s:
                    save()
                    last_save = time.monotonic()
            if history["stop"]:
                break
            epoch, first = epoch + 1, 0
            epoch_batches = make_batches(lengths, cfg.batch_size, cfg.batch_tokens, rng)
            self.position.update(rng=rng.getstate(), batches=epoch_batches, epoch=epoch, next_batch=0)
        if stats.batches:
            history["train"].append(self._record(stats, step, epoch, lr, t0, tokens_total - tokens0))
        if val and (not history["val"] or history["val"][-1]["step"] != step):
            history["val"].append({"step": step, **self.evaluate(val)})
        seconds = time.monotonic() - t0
        history.update(steps=step, seconds=round(seconds, 2), tokens=tokens_total,
                       tokens_per_s=round((tokens_total - tokens0) / seconds, 1) if seconds else 0.0,
                       epochs=round(step / max(len(epoch_batches), 1), 3))
        bar.close(step, f"stopped on {history['stop']} after {step} steps")
        return history

    @staticmethod
    def _record(stats: Stats, step: int, epoch: float, lr: float, t0: float, tokens_total: int) -> dict:
        elapsed = time.monotonic() - t0
        return {"step": step, "epoch": round(epoch, 4), "elapsed_s": round(elapsed, 2), "lr": lr,
                "tokens_per_s": round(tokens_total / elapsed, 1) if elapsed else 0.0, **stats.summary()}
