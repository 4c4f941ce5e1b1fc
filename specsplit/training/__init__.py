"""Training EAGLE-3 heads by self-distillation: `specsplit train-head`.

prompt_bank  builds the shipped prompt set (templates x topics); prompts loads and renders it
target       a frozen, batched target: static-KV generation, features and logits in one pass
distill      batched generation of the target's own responses
vocab        the draft vocabulary by token frequency, with SGLang's d2t / t2d maps
model        the trainable head, unrolled over training-time-test steps
objective    per-step soft cross-entropy to the target and per-position acceptance
loop         the optimisation loop under a step / time budget
report       JSON log and the loss / acceptance plot
pipeline     the whole command: load, generate, pick the vocabulary, train, save
"""
