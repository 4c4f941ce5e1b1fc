"""The shipped self-distillation prompt set: templates x topics, several kinds (chat,
explanations, lists, writing, coding in chat form and as raw Python to complete, math).

HumanEval is the evaluation set and is not used here: the coding tasks are our own.
Kinds are drawn by weight and duplicates skipped, so the kinds with few combinations
(raw code, coding chat) come out under their weight and math / rewriting over it.
Chat topics are split: every HELDOUT_EVERY-th topic never appears in training prompts and
feeds the held-out chat set of `bench/acceptance.py`.

  python -m specsplit.training.prompt_bank            # rewrites data/prompts.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import random
from pathlib import Path

from specsplit.training.prompt_topics import (
    ACTIVITIES,
    AUDIENCES,
    CODE_TASKS,
    LANGUAGES,
    OBJECTS,
    SUBJECTS,
    TIMES,
    TOPICS,
    VERB_PHRASES,
)

SHIPPED = Path(__file__).parent / "data" / "prompts.jsonl.gz"
HELDOUT_EVERY = 7

EXPLAIN = [
    "Explain {t} in simple terms.", "What is {t}?", "Can you explain {t} to {a}?",
    "Give me a short overview of {t}.", "Why does {t} matter?", "How would you describe {t} to {a}?",
    "What are the most common misconceptions about {t}?", "Write a short paragraph about {t}.",
    "What are the key ideas behind {t}?", "Summarize the history of {t} in a few sentences.",
    "What are the pros and cons of {t}?", "Compare {t} and {u}.", "How are {t} and {u} related?",
    "I keep hearing about {t}. What should I know?", "Explain {t} step by step.",
    "What questions should I ask to understand {t} better?", "Describe a real-world example of {t}.",
]
LISTS = [
    "List five facts about {t}.", "Give me three tips for {v}.", "What are some good ways to get better at {v}?",
    "Make a checklist for {v}.", "List the main steps of {v}.", "What mistakes do beginners make when {v}?",
    "Give me a numbered list of ideas related to {t}.", "Name four books or resources to learn about {t}.",
    "What are three advantages and three disadvantages of {v}?", "Plan a one-week schedule for {v}.",
]
WRITING = [
    "Write a short poem about {t}.", "Write a haiku about {t}.", "Write a short story that involves {t}.",
    "Write an email to {a} about {t}.", "Write a tweet about {t}.", "Write a short speech about {v}.",
    "Write a product description for an app that helps with {v}.", "Write a dialogue between two friends about {t}.",
    "Write a motivational message for someone who is {v}.", "Write a limerick about {t}.",
]
CODE_CHAT = [
    "Write a Python function `{name}({args})` to {desc}.",
    "In Python, how do I write a function to {desc}?",
    "Implement `{name}` in Python. It should {desc}.",
    "Complete this Python function:\n\n```python\ndef {name}({args}):\n    \"\"\"{Doc}\"\"\"\n```",
    "Write a {lang} function to {desc}.",
    "Write a Python function to {desc}. Add a docstring and two examples.",
    "Explain how you would write a function to {desc}, then show the code in Python.",
    "Here is a task: {desc}. Write clean, commented Python code for it.",
    "Write unit tests with pytest for a function `{name}({args})` meant to {desc}.",
    "Write a Python class with a method `{name}({args})` that can {desc}.",
    "{stub}",
    "from typing import List, Optional\n\n\n{stub}",
]
REWRITE = [
    "Rewrite this sentence in a more formal tone: \"{s}\"", "Translate into French: \"{s}\"",
    "Translate into Spanish: \"{s}\"", "Translate into German: \"{s}\"", "Turn this into a question: \"{s}\"",
    "Write a short story that starts with: \"{s}\"", "Continue this story in three sentences: \"{s}\"",
    "Rewrite this sentence in the passive voice: \"{s}\"", "Explain the grammar of this sentence: \"{s}\"",
    "Write a funny newspaper headline about this: \"{s}\"", "Rewrite this for a children's book: \"{s}\"",
]
MATH = [
    "What is {a} times {b}?", "What is {a} plus {b} minus {c}?", "Compute {a} divided by {c}, rounded to two decimals.",
    "Solve for x: {c}x + {a} = {b}.", "What is {p}% of {a}?", "Convert {c} degrees Celsius to Fahrenheit.",
    "A shop sells pencils for ${c} each. How much do {d} pencils cost?",
    "A train travels {a} km in {d} hours. What is its average speed?",
    "If I save ${c} every week, how much will I have after {d} weeks?",
    "A rectangle is {c} cm wide and {d} cm long. What are its area and perimeter?",
    "What is the square of {c}, and what is the square root of {sq}?",
    "Tom has {a} marbles and gives away {p} of them. How many does he have left?",
    "Is {a} divisible by {c}? Explain.", "What is the average of {c}, {d}, {p} and {b}?",
    "A recipe needs {d} eggs for {c} people. How many eggs do I need for {p} people?",
    "Explain how to find {p}% of {b} without a calculator.",
]


def _split(items: list[str]) -> tuple[list[str], list[str]]:
    """(train, held out): every HELDOUT_EVERY-th item is held out."""
    return [t for i, t in enumerate(items) if i % HELDOUT_EVERY], items[::HELDOUT_EVERY]


def _doc(desc: str) -> str:
    return desc[0].upper() + desc[1:] + "."


def _code_raw(name: str, args: str, desc: str) -> str:
    return f"def {name}({args}):\n    \"\"\"{_doc(desc)}\n    \"\"\"\n"


def _code_raw_kind(rng: random.Random) -> str:
    stub = _code_raw(*rng.choice(CODE_TASKS))
    return stub if rng.random() < 0.5 else "from typing import List, Optional\n\n\n" + stub


def _fill(rng: random.Random, template: str, topics: list[str], activities: list[str]) -> str:
    t, u = rng.sample(topics, 2)
    return template.format(t=t, u=u, a=rng.choice(AUDIENCES), v=rng.choice(activities))


def _math(rng: random.Random, template: str) -> str:
    a, b = rng.randint(12, 999), rng.randint(12, 999)
    c, d, p = rng.randint(2, 19), rng.randint(2, 12), rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 75])
    return template.format(a=a, b=b, c=c, d=d, p=p, sq=rng.randint(2, 30) ** 2)


def _rewrite(rng: random.Random, template: str) -> str:
    sentence = f"{rng.choice(SUBJECTS)} {rng.choice(VERB_PHRASES)} {rng.choice(OBJECTS)} {rng.choice(TIMES)}."
    return template.format(s=sentence[0].upper() + sentence[1:])


def _code_chat(rng: random.Random, template: str) -> str:
    name, args, desc = rng.choice(CODE_TASKS)
    return template.format(name=name, args=args, desc=desc, Doc=_doc(desc), lang=rng.choice(LANGUAGES),
                           stub=_code_raw(name, args, desc))


def build(seed: int = 0, train: int = 16000, heldout: int = 160) -> list[dict]:
    """Deterministic records {id, split, kind, raw, text}: train and held-out chat prompts."""
    rng = random.Random(seed)
    train_topics, held_topics = _split(TOPICS)
    train_acts, held_acts = _split(ACTIVITIES)
    kinds = [("explain", 0.24), ("list", 0.12), ("writing", 0.10), ("code", 0.20), ("code_raw", 0.04),
             ("rewrite", 0.12), ("math", 0.18)]
    seen: set[tuple[bool, str]] = set()  # a raw prompt and the same text through the chat template differ
    out: list[dict] = []
    count = {"train": 0, "heldout": 0}

    def add(split: str, kind: str, text: str) -> None:
        if (kind == "code_raw", text) not in seen:
            seen.add((kind == "code_raw", text))
            count[split] += 1
            out.append({"id": len(out), "split": split, "kind": kind, "raw": kind == "code_raw", "text": text})

    while count["train"] < train:
        kind = rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
        if kind == "explain":
            add("train", kind, _fill(rng, rng.choice(EXPLAIN), train_topics, train_acts))
        elif kind == "list":
            add("train", kind, _fill(rng, rng.choice(LISTS), train_topics, train_acts))
        elif kind == "writing":
            add("train", kind, _fill(rng, rng.choice(WRITING), train_topics, train_acts))
        elif kind == "code":
            add("train", kind, _code_chat(rng, rng.choice(CODE_CHAT)))
        elif kind == "code_raw":
            add("train", kind, _code_raw_kind(rng))
        elif kind == "rewrite":
            add("train", kind, _rewrite(rng, rng.choice(REWRITE)))
        else:
            add("train", kind, _math(rng, rng.choice(MATH)))
    while count["heldout"] < heldout:
        add("heldout", "chat", _fill(rng, rng.choice(EXPLAIN + LISTS + WRITING), held_topics, held_acts))
    return out


def write(records: list[dict], path: Path) -> None:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:  # mtime 0: byte-identical rebuilds
        for r in records:
            gz.write((json.dumps(r, ensure_ascii=False) + "\n").encode())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(SHIPPED))
    p.add_argument("--train", type=int, default=16000)
    p.add_argument("--heldout", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    records = build(a.seed, a.train, a.heldout)
    write(records, Path(a.out))
    kinds: dict[str, int] = {}
    for r in records:
        kinds[f"{r['split']}/{r['kind']}"] = kinds.get(f"{r['split']}/{r['kind']}", 0) + 1
    print(json.dumps({"out": a.out, "records": len(records), "kinds": kinds}))


if __name__ == "__main__":
    main()
