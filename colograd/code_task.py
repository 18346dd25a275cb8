"""Code tasks generated locally, with test cases in open-r1's layout, for the code rewards (`colograd.code_rewards`).

`code_sums_dataset`: chat prompts asking for a Python program that reads two integers and prints their sum; a chat
model answers with a ```` ```python ```` block, which `code` runs against three stdin/stdout cases
(``verification_info``, as open-r1's verifiable-coding datasets hold them).

`expressions_dataset`: the same idea in the tiny model's characters (`colograd.tiny`), for tests: a prompt like
``"3+4="``; the completion is taken as an expression and run as ``print(<completion>)`` (`as_print`, the
`CodeReward`'s `program`), which must print the sum. A random model writes mostly programs that do not compile.
"""

import random

from datasets import Dataset

QUESTION = (
    "Write a Python program that reads two integers a and b from one line of standard input, separated by a space, "
    "and prints their sum. Put the program in a ```python block."
)


def _info(cases: list[tuple[str, str]]) -> dict:
    return {"language": "python", "test_cases": [{"input": i, "output": o, "type": "stdin_stdout"} for i, o in cases]}


def code_sums_dataset(num_prompts: int = 256, seed: int = 0) -> Dataset:
    """Chat prompts asking for the sum program; each row's ``verification_info`` holds three cases of its own."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        pairs = [(rng.randint(-50, 50), rng.randint(-50, 50)) for _ in range(3)]
        cases = [(f"{a} {b}\n", f"{a + b}\n") for a, b in pairs]
        rows.append({"prompt": [{"role": "user", "content": QUESTION}], "verification_info": _info(cases)})
    return Dataset.from_list(rows)


def expressions_dataset(num_prompts: int = 256, seed: int = 0) -> Dataset:
    """Prompts ``"a+b="`` in the tiny model's characters; one case: no input, the sum printed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "verification_info": _info([("", f"{a + b}\n")])})
    return Dataset.from_list(rows)


def as_print(text: str) -> str:
    """The program of an `expressions_dataset` completion: the completion printed as an expression."""
    return f"print({text})\n"
