"""Does the serving path do what the head predicts? For each prompt: the target's greedy
continuation, the serving head's teacher-forced step-0 accuracy on it (one extend over the
whole sequence with the target's own capture-layer features), and the engines' mean accepted
length at num_steps 1 on the same prompt (in fp32 the two measure the same event at the
positions where cycles start). One JSON line per prompt.

  python -m bench.head_vs_engine --prompts 3 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.plain_loop import generate
from bench.prompts import CHAT_PROMPTS
from draft_service.config import DraftConfig
from draft_service.runtime import DraftRuntime
from specsplit.checkpoints.eagle_head import resolve_head_dir
from specsplit.checkpoints.target_checkpoint import resolve_target_dir
from specsplit.models.batch import Batch
from specsplit.models.parallel import TensorParallel
from specsplit.tokenizer import TextCodec
from specsplit.training.target import BatchedTarget
from target_service.config import TargetConfig
from target_service.runtime import TargetRuntime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--head", default="default")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    head = str(resolve_head_dir(a.head, a.model))
    target = TargetRuntime(TargetConfig(model=a.model, max_context=1024, max_sequences=2,
                                        draft_config=head + "/config.json").validate(), TensorParallel())
    draft = DraftRuntime(DraftConfig(head=head, target=a.model, max_context=1024, max_sequences=2).validate())
    assert target.writer is not None
    draft.attach(target.writer.descriptor)
    batched = BatchedTarget.load(a.model, "cpu", torch.float32, target.model.aux_layer_ids)
    codec = TextCodec.from_checkpoint(resolve_target_dir(a.model))
    assert codec is not None
    for text in CHAT_PROMPTS[: a.prompts]:
        ids = codec.encode(codec.render_chat(text))
        base = generate(target, None, ids, a.max_new_tokens, 0)
        spec = generate(target, draft, ids, a.max_new_tokens, 1)
        x = torch.tensor([ids + base.tokens])  # [1, T]
        with torch.no_grad():
            aux, _ = batched.features(x)
            n = x.shape[1] - 1
            cache = draft.head.new_cache(1, n + 1)
            logits, _ = draft.head(x[0, 1:], Batch.sequence(x[0, 1:], hidden=aux[0, :n]), cache)
            pred = draft.head.to_target_ids(logits.argmax(-1))  # pred[i] predicts x[i + 2]
        rows = range(len(ids) - 1, n - 1)  # predictions of response tokens after the first
        acc = sum(int(pred[i]) == int(x[0, i + 2]) for i in rows) / len(rows)
        print(json.dumps({"prompt": text[:60], "teacher_forced_step0_accuracy": round(acc, 3),
                          "engine_tau_at_1_step": round(spec.accepted_length, 3),
                          "same_tokens": spec.tokens[: a.max_new_tokens] == base.tokens[: a.max_new_tokens]}),
              flush=True)
    target.close()


if __name__ == "__main__":
    main()
