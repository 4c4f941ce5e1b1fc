"""Training EAGLE-3 heads by self-distillation: `specsplit train-head`.

The target and the head are built from the serving layers (specsplit.models: RMSNorm, Rotary
and apply_rope, the merged q/k/v and gate/up projections, o_proj and down_proj); training
keeps only its own attention patterns and the loop around them.

config         the command's settings, validated before anything loads; cli turns them into flags
prompt_bank    builds the shipped prompt set (templates x prompt_topics); prompts loads and renders it
target         the serving target model, batched: static-KV generation, features and logits in one pass
self_instruct  requests written by the target itself (pre-query sampling)
distill        batched generation of the target's own responses
vocab          the draft vocabulary by token frequency, with SGLang's d2t / t2d maps
model          the trainable head (the serving head's layers), unrolled over training-time-test steps
objective      per-step soft cross-entropy to the target and per-position acceptance
feature_cache  the target's features of every training sequence, computed once
loop           the optimisation loop under a step / time budget
progress       the progress line on stderr
report         JSON log and the loss / acceptance plot
pipeline       the whole command: load, generate, pick the vocabulary, train, save
"""
