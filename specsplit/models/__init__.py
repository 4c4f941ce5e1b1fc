"""The models: the Llama-family target, the EAGLE-3 head, their layers, tensor parallelism and the fused steps."""
