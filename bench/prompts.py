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
