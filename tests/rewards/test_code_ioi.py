"""open-r1's `ioi_code` in colograd's sandbox: its arithmetic, `add_includes` and output comparison held against
open-r1's own code and the Piston package's bash (tests/rewards/open_r1_ioi_reference.py), and real C++ solutions
compiled with an IOI-style grader (a header, grader.cpp, grader_config.json, a CMS checker), judged on subtask rows."""

import asyncio
import json
import os
import subprocess

import open_r1_ioi_reference as reference
import pytest

from colograd.errors import ConfigError
from colograd.rewards import code_ioi
from colograd.rewards.code_ioi import IoiCodeReward, add_includes, check_ioi_rows, diff_b_equal, subtask_score

SANDBOX = os.environ.get("COLOGRAD_TEST_SANDBOX", "namespaces")


# --- the arithmetic, add_includes and the comparison, against open-r1's and the Piston package's ---------------------


def open_r1(scores, precision, batch):
    """open-r1's score_subtask on a subtask whose tests score `scores`, Piston replaced by a stand-in."""

    async def run(client, problem, test_input, submission, test_output):
        return str(scores[int(test_input)]), ""

    reference.run_submission = run
    names = [f"t{i}" for i in range(len(scores))]
    subtask = {"id": "p", "subtask": "1", "score": 10, "score_precision": precision, "test_names": names,
               "test_cases": [(str(i), "x") for i in range(len(scores))]}  # fmt: skip
    return asyncio.run(reference.score_subtask(None, subtask, "int x;", test_batch_size=batch)).score


def colograd(scores, precision):
    """The judge's loop: the tests in order, up to the first 0."""
    ran = []
    for score in scores:
        ran.append(score)
        if score == 0.0:
            break
    return subtask_score(ran if len(ran) == len(scores) else [*ran, 0.0], precision)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_the_subtask_score_is_open_r1s(batch):
    for scores in ([1.0, 1.0], [1.0, 0.5, 0.25], [0.333333, 1.0], [1.0, 0.0, 1.0], [0.0], [0.5, 0.0, 0.5], [1.0]):
        for precision in (0, 2, 4):
            assert colograd(scores, precision) == open_r1(scores, precision, batch), (scores, precision)
    assert colograd([0.125, 1.0], 2) == 0.12  # by hand: Python's round, half to even


def test_add_includes_is_open_r1s():
    codes = ["", "int f() { return 0; }", '#include "nile.h"\nint f();', "std::vector<int> f();",
             "using namespace std;\nint x;", '#include "NILE.h"\nint y;']  # fmt: skip
    for code in codes:
        for problem in ("nile", "message"):
            assert add_includes(code, problem) == reference.add_includes(code, problem), (code, problem)


OUTPUTS = [
    ("1 2\n", "1 2\n"), ("1 2\n", "1  2"), ("1 2\n", "1 2 \n"), ("1 2\n", "1\t2\r\n"), ("1 2\n", " 1 2\n"),
    ("1 2\n", "1 2\n\n"), ("1 2\n\n\n", "1 2\n"), ("a\nb\n", "a b\n"), ("12\n", "1 2\n"), ("", "\n"), ("x\n", ""),
    ("  a\n", " a\n"), ("a\n", "A\n"),
]  # fmt: skip


def test_the_comparison_is_the_piston_packages(tmp_path):
    """A Batch task without a checker: 1 where the run script's `diff -bq` finds the outputs equal."""
    for expected, output in OUTPUTS:
        (tmp_path / "correct").write_text(expected)
        (tmp_path / "out").write_text(output)
        script = 'CORRECT_OUTPUT=$(cat "$1"); SOLUTION_OUTPUT="$2"' + reference.BATCH_DIFF
        argv = ["bash", "-c", script, "x", tmp_path / "correct", tmp_path / "out"]
        env = {"LC_ALL": "C", "PATH": os.environ["PATH"]}
        piston = subprocess.run(argv, text=True, capture_output=True, env=env).stdout
        assert diff_b_equal(code_ioi.echoed(expected), output) == (piston.strip() == "1"), (expected, output)


# --- real solutions in the sandbox ---------------------------------------------------------------------------------

HEADER = "#include <vector>\nlong long total(std::vector<int> a);\n"
GRADER = r"""#include "addsum.h"
#include <iostream>
#include <string>
int main() {
    std::string secret;
    int n;
    std::cin >> secret >> n;
    std::vector<int> a(n);
    for (int &x : a) std::cin >> x;
    long long r = total(a);
    std::cout << "out_secret_93b1\n" << r << "\n";
}
"""
# CMS's protocol: input, correct output, contestant output; the score on stdout, a message on stderr. 1 for the sum,
# 0.5 for one off by one; a first line that is not the output secret: no score at all (exit 1).
CHECKER = r"""#include <cstdio>
#include <cstring>
int main(int argc, char **argv) {
    FILE *want = fopen(argv[2], "r"), *got = fopen(argv[3], "r");
    char a[64] = {0}, b[64] = {0};
    long long x = 0, y = 0;
    if (fscanf(want, "%63s %lld", a, &x) != 2) return 1;
    if (fscanf(got, "%63s", b) != 1 || strcmp(a, b) != 0) return 1;
    if (fscanf(got, "%lld", &y) != 1) { printf("0\n"); fprintf(stderr, "translate:wrong\n"); return 0; }
    if (y == x) printf("1\n");
    else if (y == x + 1 || y == x - 1) printf("0.5\n");
    else printf("0\n");
    return 0;
}
"""
CONFIG = {"code": "addsum", "name": "addsum", "task_type": "Batch", "time_limit": 1.0, "memory_limit": 268435456}
TESTS = {"01": ("in_secret_77\n3\n1 2 3\n", "out_secret_93b1\n6\n"),
         "02": ("in_secret_77\n2\n2000000000 2000000000\n", "out_secret_93b1\n4000000000\n"),
         "03": ("in_secret_77\n1\n-5\n", "out_secret_93b1\n-5\n")}  # fmt: skip

RIGHT = "long long total(std::vector<int> a) { long long s = 0; for (int x : a) s += x; return s; }\n"
OFF_BY_ONE = RIGHT.replace("return s;", "return s + 1;")
INT_SUM = RIGHT.replace("long long s", "int s")  # wrong on the second test only (it overflows)
SLOW = RIGHT.replace("return s;", "volatile long long k = 0; if (s > 1000000) for (;;) k++; return s;")
NO_COMPILE = "long long total(std::vector<int> a) { return a.size() }\n"
# A solution that prints a score instead of the answer, and one that reads the expected output where the run
# script keeps it: neither holds anything but the test's input here.
PRINTS_SCORE = (
    '#include <cstdio>\n#include <cstdlib>\nlong long total(std::vector<int>) { printf("1\\n"); exit(0); }\n'
)
READS_ANSWER = r"""#include <cstdio>
#include <cstdlib>
long long total(std::vector<int>) {
    for (const char *p : {"correct_output.txt", "/sandbox/correct_output.txt", "../correct_output.txt"}) {
        FILE *f = fopen(p, "r");
        if (f) { int c; while ((c = fgetc(f)) != EOF) putchar(c); exit(0); }
    }
    return 0;
}
"""


def row(checker=True, tests=None, config=None, precision=2, **more):
    files = [["graders/addsum.h", HEADER], ["graders/grader.cpp", GRADER],
             ["graders/grader_config.json", json.dumps(config or CONFIG)]]  # fmt: skip
    if checker:
        files.append(["checker/checker.cpp", CHECKER])
    return {"id": "addsum", "subtask": "2-full", "score": 60, "score_precision": precision, "test_names": list(TESTS),
            "grader_files": files, "time_limit": 1.0, "memory_limit": 256, "year": 2031,
            "test_cases": [list(t) for t in (tests or TESTS).values()], **more}  # fmt: skip


def block(code: str) -> list[dict]:
    return [{"role": "assistant", "content": f"<think>sum</think>\n```cpp\n{code}```\n"}]


def judge(reward, programs, r):
    completions = [p if isinstance(p, list) else block(p) for p in programs]
    return reward(completions, **{k: [v] * len(programs) for k, v in r.items()})


@pytest.fixture(scope="module")
def reward():
    return IoiCodeReward(sandbox=SANDBOX, workers=2)


def test_solutions_get_the_subtask_score_by_the_checker_and_by_the_comparison(reward):
    programs = [RIGHT, OFF_BY_ONE, INT_SUM, SLOW, NO_COMPILE, [{"role": "assistant", "content": "no code"}]]
    assert judge(reward, programs, row()) == [1.0, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert judge(reward, programs, row(checker=False)) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    logs = []
    columns = {k: [v] * 3 for k, v in row().items()}
    rewards = reward([block(p) for p in (RIGHT, OFF_BY_ONE, INT_SUM)], log_extra=lambda *logged: logs.append(logged),
                     **columns)  # fmt: skip
    assert rewards == [1.0, 0.5, 0.0] and logs == [("ioi_code_failure", [None, "partial", "wrong answer"])]


def test_a_solution_that_prints_a_score_or_reads_the_answer_gets_nothing(reward):
    assert judge(reward, [PRINTS_SCORE, READS_ANSWER], row()) == [0.0, 0.0]
    assert judge(reward, [PRINTS_SCORE, READS_ANSWER], row(checker=False)) == [0.0, 0.0]


def test_what_open_r1_would_score_by_something_else_gets_no_reward(reward, caplog):
    communication = {**CONFIG, "task_type": "Communication"}
    assert judge(reward, [RIGHT], row(config=communication)) == [None]
    no_output = {**TESTS, "02": (TESTS["02"][0], "")}  # the run script would take the program's output as the score
    assert judge(reward, [RIGHT], row(tests=no_output)) == [None]
    broken = row()
    broken["grader_files"][-1] = ["checker/checker.cpp", "int main( {"]
    assert judge(reward, [RIGHT, OFF_BY_ONE], broken) == [None, None]
    said = [r.getMessage() for r in caplog.records if r.name == "colograd.rewards.code_ioi"]
    assert len(said) == 3 and all("its completions get no ioi_code reward (None)" in s for s in said), said
    assert "Communication task" in said[0] and "no expected output" in said[1] and "does not compile" in said[2]


def test_a_checker_that_scores_nothing_on_a_right_answer_is_the_problems_fault(reward):
    silent = row()
    silent["grader_files"][-1] = ["checker/checker.cpp", "int main() { return 1; }"]
    assert judge(reward, [RIGHT], silent) == [None]


def test_a_score_outside_0_to_1_is_no_score():
    """A checker that prints more than 1 (or less than 0, or NaN) for some output scores nothing for it: the output's
    fault where the checker scores the expected output 1, never a reward above 1 (open-r1 takes the number as is)."""
    reward = IoiCodeReward(sandbox=SANDBOX, workers=1)
    generous = row()  # 2 for any output that is not the expected one, 1 for the expected one
    generous["grader_files"][-1] = ["checker/checker.cpp", CHECKER.replace('printf("0.5\\n")', 'printf("2\\n")')]
    assert 'printf("2\\n")' in generous["grader_files"][-1][1]
    assert judge(reward, [RIGHT, OFF_BY_ONE], generous) == [1.0, 0.0]


def test_the_time_and_memory_limits_are_the_grader_configs(reward):
    # About 0.2 s of work on each test (measured alone: 0.19-0.20 s): within 2 s, over 0.05 s (the row says 0.1 s:
    # the config's limit is the one applied, as the CMS grader applies it).
    busy = RIGHT.replace(
        "return s;", "volatile long long k = 0; for (long long i = 0; i < 300000000; i++) k++; return s;"
    )
    assert judge(reward, [busy], row(config={**CONFIG, "time_limit": 2.0})) == [1.0]
    assert judge(reward, [busy], row(config={**CONFIG, "time_limit": 0.05}, time_limit=0.1)) == [0.0]
    big = RIGHT.replace("return s;", "std::vector<char> m(200 << 20, 1); return s + m[12345] - 1;")
    assert judge(reward, [big], row()) == [1.0]  # 200 MiB within 256
    assert judge(reward, [big], row(config={**CONFIG, "memory_limit": 64 << 20})) == [0.0]


def test_rows_ioi_code_cannot_judge_are_refused_before_the_run(reward, monkeypatch, capsys):
    def check(rows, name="ioi"):
        columns = list(rows[0])
        read = lambda names: {n: [r[n] for r in rows] for n in names}  # noqa: E731
        check_ioi_rows([reward], columns, read, name)

    check([row(), row(checker=False)])  # good rows pass
    assert capsys.readouterr().err == ""
    check([row(), row(config={**CONFIG, "task_type": "Communication"})], "ioi-mixed")  # said, not refused
    assert capsys.readouterr().err == (
        "colograd: note: ioi_code: problems addsum of dataset 'ioi-mixed' are not Batch tasks (a manager talks to the "
        "solution): they are not judged here, and their completions get no ioi_code reward (None).\n"
    )
    bad = [
        ({"test_names": []}, "test_names is not a non-empty list"),
        ({"test_cases": [["in", "out"]]}, "its test_cases do not give an \\(input, output\\) pair for each"),
        ({"id": "nile"}, "the grader's header is addsum.h, not nile.h"),
        ({"grader_files": [["graders/addsum.h", HEADER]]}, "lack graders/grader_config.json"),
        # A limit in another unit than the config's (milliseconds; kilobytes): 1000× looser or tighter, refused.
        ({"time_limit": 1000}, "grader_config.json's time_limit is 1 seconds and the row's time_limit is 1000, 1000×"),
        ({"memory_limit": 262144}, "memory_limit is 256 MiB .* and the row's memory_limit is 262144, 1024×"),
    ]
    for change, said in bad:
        with pytest.raises(ConfigError, match=f"reward function 'ioi_code': dataset 'ioi' row 1: problem .*{said}"):
            check([row(), {**row(), **change}])
    without = {k: v for k, v in row().items() if k != "score_precision"}
    with pytest.raises(ConfigError, match="dataset 'ioi' lacks score_precision; give open-r1/ioi's columns"):
        check([without])
    # No test_cases: the year's tests come from the Hub, loaded before the run (here offline, not cached).
    # Offline as a run started with HF_HUB_OFFLINE=1 is: both libraries read it once, at import.
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    code_ioi._loaded_year.cache_clear()
    hub_rows = [{k: v for k, v in row().items() if k != "test_cases"}]
    with pytest.raises(
        ConfigError, match=r"the tests of year 2031 \(open-r1/ioi-test-cases, config 2031\) cannot be"
    ) as err:
        check(hub_rows)
    assert "\n" not in str(err.value) and "give the rows a test_cases column" in str(err.value)
    assert "OfflineModeIsEnabled" in str(err.value)  # refused by offline mode, not after the network's retries


def test_the_hubs_tests_are_read_by_year_and_problem(reward, monkeypatch):
    """Rows without test_cases take them from open-r1/ioi-test-cases (stood in for: a year's rows, as the Hub holds
    them), as open-r1's `load_ioi_tests` reads them."""
    import datasets

    hub = [
        {"year": 2031, "day": 1, "problem_name": "Add sum", "problem_id": pid, "test_name": name,
         "test_input": t[0], "test_output": t[1]}
        for pid in ("addsum", "other") for name, t in TESTS.items()
    ]  # fmt: skip
    loaded = []

    def load_dataset(path, name=None, split=None):
        loaded.append((path, name, split))
        return datasets.Dataset.from_list(hub)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    code_ioi._loaded_year.cache_clear()
    hub_row = {k: v for k, v in row().items() if k != "test_cases"}
    assert judge(reward, [RIGHT, OFF_BY_ONE], hub_row) == [1.0, 0.5]
    assert judge(reward, [RIGHT], hub_row) == [1.0]
    assert loaded == [("open-r1/ioi-test-cases", "2031", "train")]  # once per year
    code_ioi._loaded_year.cache_clear()


def test_rows_as_a_dataset_file_loads_them_pass_preflight_and_score(reward, tmp_path):
    """open-r1/ioi's nested columns (grader_files' pairs, test_cases) through `datasets`' Arrow round trip, as
    `dataset_name` loads a local file."""
    from colograd.config.data import ScriptArguments
    from colograd.data.core import load_prompts

    path = tmp_path / "ioi.jsonl"
    rows = [{"problem": "Sum the numbers.", **row()}, {"problem": "Sum them.", **row(checker=False)}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = load_prompts(ScriptArguments(dataset_name=str(path), dataset_prompt_column="problem"))
    check_ioi_rows([reward], dataset.column_names, lambda names: dataset.select_columns(names)[:], "ioi")
    columns = {c: dataset[c] for c in dataset.column_names if c != "prompt"}
    assert reward([block(RIGHT), block(OFF_BY_ONE)], **columns) == [1.0, 0.0]  # the second row compares outputs
