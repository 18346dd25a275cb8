"""Code tasks generated locally, with tests in the layouts code datasets use, for the code rewards
(`colograd.rewards.code`).

`code_sums_dataset`: chat prompts asking for a Python program that reads two integers and prints their sum; a chat
model answers with a ```` ```python ```` block, which `code` runs against three stdin/stdout cases
(``verification_info``, as open-r1's verifiable-coding datasets hold them).

`code_functions_dataset`: chat prompts asking for a Python function ``add(a, b)``; `code` runs the block against three
assert statements (``test_list``, as MBPP holds them), all in one execution.

`expressions_dataset`: the same idea in the tiny model's characters (`colograd.models.tiny`), for tests: a prompt like
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


FUNCTION_QUESTION = (
    "Write a Python function add(a, b) that returns the sum of the integers a and b. Put the function in a ```python "
    "block."
)


def code_functions_dataset(num_prompts: int = 256, seed: int = 0) -> Dataset:
    """Chat prompts asking for ``add(a, b)``; each row's ``test_list`` holds three assert statements of its own, with
    MBPP's ``test_setup_code`` and ``test_imports`` (empty)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        pairs = [(rng.randint(-50, 50), rng.randint(-50, 50)) for _ in range(3)]
        tests = [f"assert add({a}, {b}) == {a + b}" for a, b in pairs]
        rows.append({"prompt": [{"role": "user", "content": FUNCTION_QUESTION}], "test_list": tests,
                     "test_setup_code": "", "test_imports": []})  # fmt: skip
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
