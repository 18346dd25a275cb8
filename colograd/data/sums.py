"""A chat task generated locally, with a verifiable reward: add two numbers and reply with the sum.

Prompts are conversations (``[{"role": "user", "content": "What is 12 + 7? Reply with just the number."}]``)
so the model's chat template applies; the ``answer`` column holds the sum. A small pretrained chat model
(SmolLM2-135M-Instruct) gets ~13% right at temperature 1, often rambling past the number; the reward rises as it
learns to answer briefly and correctly.
"""

import random
import re

from datasets import Dataset

QUESTION = "What is {a} + {b}? Reply with just the number."
_NUMBER = re.compile(r"-?\d+")


def sums_dataset(num_prompts: int = 4096, low: int = 1, high: int = 30, seed: int = 0) -> Dataset:
    """Conversational prompts asking for ``a + b`` with `a`, `b` drawn uniformly from [`low`, `high`];
    the ``answer`` column is the sum, as text."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        a, b = rng.randint(low, high), rng.randint(low, high)
        rows.append({"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": str(a + b)})
    return Dataset.from_list(rows)


def sum_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1.0 where the completion's last number is the answer, else 0.0 (also when it has no number).

    Args:
        completions: texts, or (conversational prompts) one-message lists ``[{"role": "assistant", ...}]``.
        answer: the expected sums, as text.
    """
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(_last_number(t) == a) for t, a in zip(texts, answer, strict=True)]


def _last_number(text: str) -> str | None:
    """The last integer written in `text` (with its sign), or None."""
    numbers = _NUMBER.findall(text)
    return str(int(numbers[-1])) if numbers else None
