"""Checkpoints: GGUF and safetensors targets, SGLang/SpecForge EAGLE-3 heads, timing shapes with random weights."""
