"""A small fixed set of chat prompts for benchmarks (not training data)."""

CHAT_PROMPTS = [
    "Write a short Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "List three tips for writing clear technical documentation.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a string in JavaScript?",
    "Give me a recipe for a simple tomato soup.",
]

# Where a draft does well and where it does not: code, chat, repetitive text (bench/adaptive_steps.py)
MIXED_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and type hints.",
    "Write a bash script that counts the lines of every .py file in a directory.",
    "Explain in three sentences why the sky is blue.",
    "Give me three tips for sleeping better.",
    "Repeat the sentence 'The quick brown fox jumps over the lazy dog.' ten times, one per line.",
    "Count from 1 to 60, separated by commas.",
]


def token_prompts(vocab: int, n: int, length: int = 64) -> list[list[int]]:
    """n fixed prompts of `length` token ids for a model without a tokenizer (a shape with random
    weights)."""
    return [[1 + (i * 7919 + j * 104729) % (vocab - 1) for j in range(length)] for i in range(n)]
