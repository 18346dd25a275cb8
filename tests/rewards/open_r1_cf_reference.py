# coding=utf-8
# Copyright 2025 The HuggingFace Team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# fmt: off
# ruff: noqa
"""open-r1's Codeforces scoring as open-r1 ships it (huggingface/open-r1 @ 1416fa0cf21595d2083b399a2a0bbddd7f6e9563,
src/open_r1/utils/competitive_programming/cf_scoring.py `score_submission` and utils.py `batched`, copied
unchanged), and the output comparison of the Piston package it runs on (guipenedo/piston @
7a38da2, packages/codeforces/1.0.0/run, `normalize_output`, copied unchanged as bash), the reference that
tests/rewards/test_code_codeforces.py holds colograd.rewards.code_codeforces against. `score_single_test_case` (a
Piston request) and `get_generated_tests` (a parquet read) are the test's stand-ins, set on this module. Not imported by
colograd."""

from __future__ import annotations  # the copied signature names PistonClient, not imported here

import asyncio
from itertools import islice
from typing import Literal


def batched(iterable, n):
    "Batch data into lists of length n. The last batch may be shorter."
    # batched('ABCDEFG', 3) --> ABC DEF G
    if n < 1:
        return iterable
    it = iter(iterable)
    while batch := list(islice(it, n)):
        yield batch


async def score_submission(
    client: PistonClient,
    problem_data: dict,
    submission: str,
    test_batch_size: int = 1,
    scoring_mode: Literal["pass_fail", "partial", "weighted_sum"] = "weighted_sum",
    no_compile_reward: float = -0.1,
    no_submission_reward: float = -1.0,
    submission_language: str = "cpp",
) -> float:
    if submission_language not in ["python", "cpp"]:
        raise ValueError(f"Invalid submission language: {submission_language}")
    test_cases = problem_data["official_tests"] + (await get_generated_tests(problem_data["id"]))
    # invalid/not a coding problem
    if test_cases is None or len(test_cases) == 0:
        return None
    # no code extracted
    if not submission:
        return no_submission_reward

    passed_test_cases = 0
    # run one batch, check if any of them failed (0 score): if so stop evaluating (assuming non partial score); otherwise continue with the next batch of test cases.
    for test_batch_to_run in batched(test_cases, test_batch_size) if test_batch_size >= 1 else [test_cases]:
        results = await asyncio.gather(
            *[
                asyncio.create_task(
                    score_single_test_case(
                        client, problem_data, test_case["input"], test_case["output"], submission, submission_language
                    )
                )
                for test_case in test_batch_to_run
            ]
        )
        if any(result and result["compile"]["code"] != 0 for result in results):
            return no_compile_reward

        tests_passed_results = [
            result and result["run"]["code"] == 0 and result["run"]["stdout"].strip() == "1" for result in results
        ]
        if scoring_mode == "pass_fail" and any(not test_passed for test_passed in tests_passed_results):
            break
        passed_test_cases += sum(1 for test_passed in tests_passed_results if test_passed)

    pass_fail_score = 1.0 if passed_test_cases == len(test_cases) else 0.0

    if scoring_mode == "pass_fail":
        return pass_fail_score
    elif scoring_mode == "partial":
        return passed_test_cases / len(test_cases)
    elif scoring_mode == "weighted_sum":
        return pass_fail_score + 0.1 * (passed_test_cases / len(test_cases))
    else:
        raise ValueError(f"Invalid scoring mode: {scoring_mode}")


# packages/codeforces/1.0.0/run's normalize_output, as bash
NORMALIZE_OUTPUT = r"""
function normalize_output {
    local filename="$1"
    # 1. Use sed line-by-line for case-insensitive yes/no replacement (GNU extensions: -E for extended regex, \b for word boundary, i for case-insensitive)
    # 2. Use tr to replace newlines with spaces 
    # 3. Use tr again to squeeze all resulting whitespace sequences into single spaces
    # 4. Use sed to trim leading/trailing space from the final single line
    <"$filename" sed -E 's/\b(yes)\b/YES/ig; s/\b(no)\b/NO/ig' | tr '\n' ' ' | tr -s '[:space:]' ' ' | sed 's/^ //;s/ $//'
}
"""
