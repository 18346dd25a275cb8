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
"""open-r1's IOI scoring as open-r1 ships it (huggingface/open-r1 @ 1416fa0cf21595d2083b399a2a0bbddd7f6e9563,
src/open_r1/utils/competitive_programming/ioi_scoring.py from `TestResult` to `score_subtask`, utils.py `batched` and
ioi_utils.py `add_includes`, copied unchanged), and the Batch task's output comparison of the Piston package it runs
on (guipenedo/piston @ 7a38da202481bb7a85647a2c6cdc00990ad051bc, packages/cms_ioi/1.0.0/run, copied unchanged as
bash), the reference that tests/rewards/test_code_ioi.py holds colograd.rewards.code_ioi against. `run_submission` (a
Piston request) and `load_ioi_tests` (a Hub read) are the test's stand-ins, set on this module. Not imported by
colograd."""

from __future__ import annotations  # the copied signatures name PistonClient, not imported here

import asyncio
from dataclasses import asdict, dataclass, field
from itertools import islice
from typing import Union

run_submission = None  # the test's stand-in: (client, problem, test_input, submission, test_output) -> (score, feedback)
load_ioi_tests = None  # the test's stand-in: (year, problem_id) -> {test_name: (input, output)}


# utils.py
def batched(iterable, n):
    "Batch data into lists of length n. The last batch may be shorter."
    # batched('ABCDEFG', 3) --> ABC DEF G
    if n < 1:
        return iterable
    it = iter(iterable)
    while batch := list(islice(it, n)):
        yield batch


# ioi_utils.py
def add_includes(code: str, problem_id: str) -> str:
    """
    Fix common compilation errors for IOI problems.
    """
    if not code:
        return code
    # has most of the useful functions
    code_header = "#include <bits/stdc++.h>\n"
    # include the problem header
    problem_header_include = f'#include "{problem_id}.h"'
    if problem_header_include not in code:
        code_header += problem_header_include + "\n"
    # use namespace std since models forget std:: often
    if "using namespace std;" not in code and "std::" not in code:
        code_header += "\nusing namespace std;\n\n"
    return code_header + code


# ioi_scoring.py
@dataclass
class TestResult:
    """
    Represents the result of a single test case execution.

    Attributes:
        test_name: Name of the test case
        score: Score achieved for this test (0.0 to 1.0)
        status: Status code of the test result (e.g., 'AC', 'WA', 'TLE')
        feedback: Detailed feedback message from the judge or an error message
    """

    test_name: str
    score: float = 0.0
    status: str = "SKIPPED"
    feedback: str = None


@dataclass
class SubtaskResult:
    """
    Represents the result of a subtask containing multiple test cases.

    Attributes:
        problem: Problem identifier
        subtask: Subtask identifier
        points: Maximum points available for this subtask
        score_precision: Number of decimal places for score rounding
        test_results: List of individual test case results
    """

    problem: str = None
    subtask: str = None

    points: float = 0.0
    score_precision: int = 2

    test_results: list[TestResult] = field(default_factory=list)

    @property
    def status(self):
        """
        Determines the overall status of the subtask based on the worst status among test results.
        Status priorities are ordered from worst to best.

        Returns:
            str: The status with the highest priority (lowest value)
        """
        status_prios = {"CE": -1, "RE": 0, "WA": 1, "MLE": 2, "TLE": 3, "PA": 4, "AC": 5, "SKIPPED": 999}
        return min([x.status for x in self.test_results], key=lambda x: status_prios[x])

    @property
    def score(self):
        """
        Calculates the raw score for the subtask as the minimum score across all test results.

        Returns:
            float: The rounded minimum score
        """
        return (
            0
            if not self.test_results
            else round(min([test_result.score for test_result in self.test_results]), self.score_precision)
        )

    @property
    def weighted_score(self):
        """
        Calculates the weighted score by multiplying the raw score by the available points.

        Returns:
            float: The rounded weighted score
        """
        return (
            0
            if not self.test_results
            else round(
                min([test_result.score for test_result in self.test_results]) * self.points, self.score_precision
            )
        )

    def to_dict(self):
        """
        Converts the SubtaskResult to a dictionary representation.

        Returns:
            dict: Dictionary containing all subtask result data
        """
        return {
            "problem": self.problem,
            "subtask": self.subtask,
            "score": self.score,
            "weighted_score": self.weighted_score,
            "points": self.points,
            "score_precision": self.score_precision,
            "status": self.status,
            "test_results": [asdict(test_result) for test_result in self.test_results],
        }


def _extract_single_status(score: float, feedback: str) -> str:
    """
    Determines the status code based on the score and feedback message.

    Args:
        score: The numeric score (0.0 to 1.0)
        feedback: The feedback message from the execution

    Returns:
        str: Status code ('CE', 'MLE', 'TLE', 'WA', 'RE', 'AC', or 'PA')
    """
    if score == 0.0:
        if "Compilation error" in feedback:
            return "CE"
        elif "Memory limit exceeded" in feedback:
            return "MLE"
        elif "Time limit exceeded" in feedback:
            return "TLE"
        elif "Output isn't correct" in feedback:
            return "WA"
        else:
            return "RE"
    elif score == 1.0:
        return "AC"
    else:
        return "PA"


async def score_single_test_case(
    client: PistonClient, subtask: dict, test_name: str, test_input: str, test_output: str, submission: str
) -> TestResult:
    """
    Scores a single test case by running the submission against the provided input and output.

    Args:
        client: PistonClient instance for executing code
        subtask: Dictionary containing subtask configuration
        test_name: Name of the test case
        test_input: Input data for the test case
        test_output: Expected output for the test case
        submission: Source code of the submission

    Returns:
        TestResult: Result of the test case execution
    """
    # Run submission for this test case
    score, feedback = await run_submission(client, subtask, test_input, submission, test_output)
    score = float(score)

    return TestResult(
        test_name=test_name, score=score, status=_extract_single_status(score, feedback), feedback=feedback
    )


async def score_subtask(
    client: PistonClient,
    subtask: dict,
    submission: str,
    test_case_run_cache: Union[dict, None] = None,
    test_batch_size: int = 1,
) -> SubtaskResult:
    """
    Scores all test cases in a subtask.

    Args:
        client: PistonClient instance for executing code
        subtask: Dictionary containing subtask configuration
        test_cases: Dictionary mapping test names to (input, output) tuples
        submission: Source code of the submission
        test_case_run_cache: Optional cache of previously run test cases
        test_batch_size: evaluate these many test cases in parallel, then check if any of them failed (0 score): if so stop evaluating; otherwise continue with the next batch of test cases.
        -1 to evaluate all test cases in parallel
    Returns:
        SubtaskResult: Result of the subtask evaluation
    """
    subtask_result = SubtaskResult(
        problem=subtask["id"],
        subtask=subtask["subtask"],
        points=subtask["score"],
        score_precision=subtask["score_precision"],
        test_results=[],
    )

    # tests that are not cached
    tests_to_run = [
        (ti, test_name)
        for ti, test_name in enumerate(subtask["test_names"])
        if test_case_run_cache is None or test_name not in test_case_run_cache
    ]

    # initialize test results with cached results or empty (SKIPPED) TestResult objects
    subtask_result.test_results = [
        test_case_run_cache[test_name]
        if test_case_run_cache is not None and test_name in test_case_run_cache
        else TestResult(test_name=test_name)
        for test_name in subtask["test_names"]
    ]

    # we skip submissions where no code was extracted
    # no need to do anything, as we have a failed cached result
    if not submission or any(
        test_result.status != "SKIPPED" and test_result.score == 0.0 for test_result in subtask_result.test_results
    ):
        return subtask_result

    if "test_cases" in subtask:
        test_cases = subtask["test_cases"]
        if isinstance(subtask["test_cases"], list):
            test_cases = {test_name: test for test_name, test in zip(subtask["test_names"], subtask["test_cases"])}
    else:
        test_cases = load_ioi_tests(subtask["year"], subtask["id"])

    # run one batch, check if any of them failed (0 score): if so stop evaluating; otherwise continue with the next batch of test cases.
    for test_batch_to_run in batched(tests_to_run, test_batch_size):
        results = await asyncio.gather(
            *[
                asyncio.create_task(
                    score_single_test_case(
                        client, subtask, test_name, test_cases[test_name][0], test_cases[test_name][1], submission
                    )
                )
                for _, test_name in test_batch_to_run
            ]
        )
        for (ti, test_name), test_result in zip(test_batch_to_run, results):
            if test_case_run_cache is not None:
                test_case_run_cache[test_name] = test_result
            subtask_result.test_results[ti] = test_result

        # Stop early if it failed
        if any(test_result.score == 0.0 for test_result in results):
            break

    return subtask_result


# packages/cms_ioi/1.0.0/run, the Batch task without a checker: "$CORRECT_OUTPUT" holds `$(cat correct_output.txt)`,
# "$SOLUTION_OUTPUT" names the program's output file. The test runs it with both set.
BATCH_DIFF = """
                if diff -bq <(echo "$CORRECT_OUTPUT") "$SOLUTION_OUTPUT" >/dev/null; then
                    echo "1"
                    echo "Output is correct (diff)" >&2
                else
                    echo "0"
                    echo "Output isn't correct (diff)" >&2
                    exit 0
                fi
"""
