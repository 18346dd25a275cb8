"""Code rewards: a rollout of the tiny code task scored while it decodes against scored after it, the sandbox's own
cost per execution against a bare subprocess, the split harness's cost per completion against the
single-interpreter harness it replaced, and completions per second on a CodeContests-shaped workload (50 stdin/stdout
cases a problem) against one unsandboxed interpreter (`contest_throughput`).

The workload: P prompts × G completions of the tiny model on `colograd.data.code_task.expressions_dataset`, each
completion run in the sandbox as a program (`print(<completion>)`) against its test case. Completions stop at any of
a few characters (a stop string), so they end at varied lengths as a real model's do, and a group is scored while
the longer ones decode. Both ways run the same trainer, engine and reward, alternately; medians are reported.
TRL's rollout of the same task (`model.generate`, then the reward) is timed after them.
"""

import json
import os
import secrets
import statistics
import subprocess
import tempfile
import time

from colograd.data import code_task
from colograd.models import tiny
from colograd.rewards.code import CodeReward
from colograd.rewards.code_tests import AssertTests, row_tests, run_asserts
from colograd.rewards.sandbox import Sandbox

PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD = "def add(a, b):\n    return a + b\n"
# Assert-style workloads for the harness comparison: MBPP's shape (three asserts, one call each) and HumanEval's
# (check(candidate) with a loop of calls).
HARNESS_ROWS = {
    "MBPP (3 asserts)": {"test_list": ["assert add(1, 2) == 3", "assert add(0, 5) == 5", "assert add(-1, 1) == 0"]},
    "HumanEval (check, 20 calls)": {
        "test": "def check(candidate):\n    for i in range(20):\n        assert candidate(i, 1) == i + 1\n",
        "entry_point": "add",
    },
}

# The single-interpreter harness the split replaced (colograd before the split), kept here as the baseline: the
# program and the tests in one interpreter, each test's outcome printed after a secret read from stdin. Its
# weaknesses are docs/rewards.md's; only its cost is measured.
_SINGLE = """\
import os
import sys


def _outcome(err):
    if isinstance(err, AssertionError):
        return "wrong answer"
    return "error: " + type(err).__name__


def _run(setup, program, tests, exec=exec, compile=compile, outcome_of=_outcome, write=os.write):
    nonce = sys.stdin.readline().strip()
    namespace = {"__name__": "solution"}
    try:
        exec(compile(setup, "<test setup>", "exec"), namespace)
        exec(compile(program, "solution.py", "exec"), namespace)
        failed = None
    except BaseException as err:
        failed = outcome_of(err)
    for i, test in enumerate(tests):
        outcome = failed
        if outcome is None:
            try:
                exec(compile(test, "<test %d>" % i, "exec"), namespace)
                outcome = "ok"
            except BaseException as err:
                outcome = outcome_of(err)
        write(1, ("\\n%s %d %s\\n" % (nonce, i, outcome)).encode())
"""


def single_interpreter(sandbox: Sandbox, tests: AssertTests, code: str) -> list[str | None]:
    """Each test's failure reason (None: passed) under the single-interpreter harness."""
    nonce = secrets.token_hex(16)
    setup = "\n".join(filter(None, [tests.imports, tests.setup]))
    execution = sandbox.run(f"{_SINGLE}\n_run({setup!r}, {code!r}, {list(tests.tests)!r})\n", f"{nonce}\n")
    reports = {}
    for line in execution.stdout.split("\n"):
        mark, _, rest = line.partition(" ")
        index, _, outcome = rest.partition(" ")
        if mark == nonce and index.isdigit():
            reports[int(index)] = outcome
    return [None if reports.get(i) == "ok" else reports.get(i, "ended") for i in range(len(tests.tests))]


def harness_cost(repeats: int = 15) -> dict[str, dict[str, float]]:
    """Median seconds per completion of each assert-style workload through the single-interpreter harness and the
    split one, in the same sandbox, alternately; and the ratio."""
    sandbox = Sandbox()
    figures = {}
    for name, row in HARNESS_ROWS.items():
        tests = row_tests(row)
        ways = {"single": lambda t=tests: single_interpreter(sandbox, t, ADD),
                "split": lambda t=tests: run_asserts(sandbox, t, ADD).failures}  # fmt: skip
        for way in ways.values():  # warm-up; both ways must pass the right program
            assert way() == [None] * len(tests.tests)
        seconds: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(repeats):
            for way, call in ways.items():
                start = time.perf_counter()
                call()
                seconds[way].append(time.perf_counter() - start)
        medians = {way: statistics.median(values) for way, values in seconds.items()}
        figures[name] = {**medians, "ratio": medians["split"] / medians["single"]}
    return figures


def sandbox_overhead(executions: int = 20) -> dict[str, float]:
    """Median seconds per execution of one small program: a bare `python -I` subprocess, the sandbox, the sandbox
    without the protections beyond its namespaces (seccomp, memory cgroup, keyring, IPC limits), and the unisolated
    opt-in (its launcher, rlimits and caps without namespaces)."""
    isolated, bare_namespaces, unisolated = Sandbox(), Sandbox(protections=()), Sandbox(isolated=False)
    with tempfile.TemporaryDirectory() as folder:
        with open(f"{folder}/main.py", "w") as f:
            f.write(PROGRAM)

        def bare() -> None:
            subprocess.run([isolated.python, "-I", "main.py"], cwd=folder, input=b"3 4\n", capture_output=True)

        calls = {"bare": bare, "sandbox": lambda: isolated.run(PROGRAM, "3 4\n"),
                 "namespaces only": lambda: bare_namespaces.run(PROGRAM, "3 4\n"),
                 "unisolated": lambda: unisolated.run(PROGRAM, "3 4\n")}  # fmt: skip
        seconds: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(executions):  # alternately, so that the machine's load falls on each alike
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
        times = {name: statistics.median(values) for name, values in seconds.items()}
    return times


# The CodeContests-shaped workload: each problem's cases are a list of numbers on stdin (its length on the first line)
# and their sum, as CodeContests' generated tests are many small inputs of one format; the program is a correct
# solution, so that every case runs.
CONTEST_PROGRAM = "import sys\nn, *values = map(int, sys.stdin.read().split())\nprint(sum(values[:n]))\n"


def contest_rows(problems: int, cases: int) -> list[dict]:
    """`problems` rows in CodeContests' layout (public, private and generated tests), `cases` cases each."""
    rows = []
    for p in range(problems):
        inputs = [[(p * 7919 + c * 104729 + k * 31) % 2001 - 1000 for k in range(1 + (p + c) % 40)]
                  for c in range(cases)]  # fmt: skip
        tests = {"input": [f"{len(v)}\n{' '.join(map(str, v))}\n" for v in inputs],
                 "output": [f"{sum(v)}\n" for v in inputs]}  # fmt: skip
        public = {"input": tests["input"][:1], "output": tests["output"][:1]}
        private = {"input": tests["input"][1:10], "output": tests["output"][1:10]}
        generated = {"input": tests["input"][10:], "output": tests["output"][10:]}
        rows.append({"public_tests": public, "private_tests": private, "generated_tests": generated})
    return rows


def unsandboxed_rate(python: str, rows: list[dict], completions: int, program: str) -> float:
    """Completions per second of one unsandboxed interpreter at a time running every case of each completion: a bare
    `python -I main.py` subprocess per case, its output compared by the same checker, one after the other."""
    from colograd.rewards.code import output_matches

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        with open(f"{folder}/main.py", "w") as f:
            f.write(program)
        for row in rows:
            for _ in range(completions):
                for stdin, expected in row_tests(row).cases:
                    done = subprocess.run([python, "-I", "main.py"], cwd=folder, input=stdin.encode(),
                                          capture_output=True, timeout=60)  # fmt: skip
                    if done.returncode != 0 or not output_matches(done.stdout.decode(), expected):
                        raise RuntimeError("the contest workload's program failed a case unsandboxed")
    return len(rows) * completions / (time.perf_counter() - start)


def contest_throughput(repeats: int = 3, problems: int = 2, completions: int = 4, cases: int = 50) -> dict:
    """Completions per second on the CodeContests-shaped workload (`contest_rows`): `problems` × `completions`
    correct programs scored by the `code` reward (its pool, sandboxed), by the same reward with one worker, and by
    one unsandboxed interpreter (`unsandboxed_rate`); alternately, medians, and the ratios to the unsandboxed rate."""
    rows = contest_rows(problems, cases)
    rewards = {"sandboxed": CodeReward(), "sandboxed, 1 worker": CodeReward(workers=1)}
    # Distinct programs (a comment apart): the reward runs a program that is the same as another of its call once.
    completions_text = [f"```python\n{CONTEST_PROGRAM}# {i}\n```" for i in range(completions)]
    rates: dict[str, list[float]] = {name: [] for name in (*rewards, "unsandboxed")}
    for _ in range(repeats):
        for name, reward in rewards.items():
            start = time.perf_counter()
            for row in rows:  # one rollout: a problem's completions scored together, as a trainer's call does
                columns = {k: [v] * completions for k, v in row.items()}
                if reward(completions_text, **columns) != [1.0] * completions:
                    raise RuntimeError("the contest workload's program failed a case in the sandbox")
            rates[name].append(len(rows) * completions / (time.perf_counter() - start))
        rates["unsandboxed"].append(unsandboxed_rate(rewards["sandboxed"].sandbox.python, rows, completions,
                                                     CONTEST_PROGRAM))  # fmt: skip
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {"completions_per_s": medians, "problems": problems, "completions": completions, "cases": cases,
            "workers": rewards["sandboxed"].workers,
            "ratio": medians["sandboxed"] / medians["unsandboxed"],
            "ratio_1_worker": medians["sandboxed, 1 worker"] / medians["unsandboxed"]}  # fmt: skip


def print_contest(figures: dict) -> None:
    rate = figures["completions_per_s"]
    print(
        f"  CodeContests-shaped: {figures['problems']} problems × {figures['completions']} correct completions, "
        f"{figures['cases']} stdin/stdout cases each: sandboxed ({figures['workers']} workers) "
        f"{rate['sandboxed']:.2f} completions/s, 1 worker {rate['sandboxed, 1 worker']:.2f}, one unsandboxed "
        f"interpreter {rate['unsandboxed']:.2f}; ratio {figures['ratio']:.2f} ({figures['ratio_1_worker']:.2f} "
        "with 1 worker)"
    )


def trl_rollout_seconds(reward: CodeReward, prompts: int, generations: int, repeats: int) -> float:
    """Median seconds of TRL 1.16's rollout on the same task: `model.generate` (`use_vllm=False`, its configuration
    that runs on a CPU), then the same reward called after generation. Its completions run to the length limit (its
    generation is not given the stop strings), so they are not the same completions as colograd's."""
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    dataset = code_task.expressions_dataset(prompts)
    with tempfile.TemporaryDirectory() as out:
        args = TRLConfig(output_dir=out, use_vllm=False, num_generations=generations, report_to="none",
                         per_device_train_batch_size=prompts * generations, max_completion_length=48,
                         use_cpu=True)  # fmt: skip
        trainer = TRLTrainer(model=tiny.build_model(), reward_funcs=reward, args=args, train_dataset=dataset,
                             processing_class=tiny.build_tokenizer())  # fmt: skip
        rows = [dataset[i] for i in range(prompts) for _ in range(generations)]  # TRL's sampler repeats each G times
        trainer._generate_and_score_completions(rows)  # warm-up
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            trainer._generate_and_score_completions(rows)
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def run(
    repeats: int = 3, as_json: bool = False, prompts: int = 8, generations: int = 8, contest_only: bool = False
) -> dict:
    """Time `repeats` rollouts each way; print a table (or one JSON line) and return the figures. `contest_only`:
    the CodeContests-shaped workload alone (`contest_throughput`)."""
    contest = contest_throughput(repeats)
    if contest_only:
        if as_json:
            print(json.dumps({"contest": contest}))
        else:
            print("code rewards:")
            print_contest(contest)
        return {"contest": contest}
    from colograd.trainer import GRPOTrainer  # torch and vLLM only when the benchmark runs

    overhead = sandbox_overhead()
    harness = harness_cost()
    reward = CodeReward(program=code_task.as_print)
    executions = []
    run_in_sandbox = reward.sandbox.run
    reward.sandbox.run = lambda *a: executions.append(1) or run_in_sandbox(*a)
    dataset = code_task.expressions_dataset(prompts)
    with tempfile.TemporaryDirectory() as out:
        args = tiny.run_config(out, 1, num_generations=generations, per_device_train_batch_size=prompts * generations,
                               max_completion_length=48, generation_kwargs={"stop": ["a", "b", "c"]})  # fmt: skip
        trainer = GRPOTrainer(tiny.build_model(), reward, args, dataset, processing_class=tiny.build_tokenizer())
        rows = [dataset[i] for i in range(prompts)]
        trainer.sample(rows)  # warm-up: the first sync and the engine's first steps
        seconds: dict[str, list[float]] = {"while decoding": [], "afterwards": []}
        ran: dict[str, list[int]] = {"while decoding": [], "afterwards": []}
        phases: dict[str, dict[str, list[float]]] = {way: {"generate": [], "reward": []} for way in seconds}
        for _ in range(repeats):
            for way in seconds:
                reward.scores_while_decoding = way == "while decoding"
                executions.clear()
                trainer._times.reset()
                start = time.perf_counter()
                trainer.sample(rows)
                seconds[way].append(time.perf_counter() - start)
                ran[way].append(len(executions))
                for phase, values in phases[way].items():
                    values.append(trainer._times.seconds[phase])
    medians = {way: statistics.median(s) for way, s in seconds.items()}
    phase_s = {way: {phase: statistics.median(v) for phase, v in p.items()} for way, p in phases.items()}
    # Scoring while decoding can at best hide the shorter of the two phases behind the longer one.
    after = phase_s["afterwards"]
    ceiling = medians["afterwards"] / max(after["generate"], after["reward"])
    reward.scores_while_decoding = False  # TRL calls its rewards after generation
    medians["trl"] = trl_rollout_seconds(reward, prompts, generations, repeats)
    result = {
        "rollout_s": medians,
        "speedup": medians["afterwards"] / medians["while decoding"],
        "phases_s": phase_s,
        "overlap_ceiling": ceiling,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "executions_per_rollout": statistics.median(ran["afterwards"]),
        "speedup_vs_trl": medians["trl"] / medians["while decoding"],
        "executions_per_s": {way: statistics.median(ran[way]) / medians[way] for way in ran},
        "workers": reward.workers,
        "execution_s": overhead,
        "sandbox_overhead_s": overhead["sandbox"] - overhead["bare"],
        "harness_s": harness,
        "contest": contest,
    }
    if as_json:
        print(json.dumps(result))
        return result
    print(f"code rewards: {prompts} prompts × {generations} completions of the tiny model, {reward.workers} workers")
    for way in ran:
        rate = result["executions_per_s"][way]
        print(
            f"  scored {way:<15} {medians[way]:6.2f} s per rollout   {rate:6.1f} executions/s   (generate "
            f"{phase_s[way]['generate']:.2f} s, then reward {phase_s[way]['reward']:.2f} s)"
        )
    print(f"  TRL (generate, then reward) {medians['trl']:6.2f} s per rollout")
    print(
        f"  speed-up {result['speedup']:.2f}× over scoring afterwards, {result['speedup_vs_trl']:.2f}× over TRL "
        f"({result['executions_per_rollout']:.0f} executions per rollout); a perfect overlap's ceiling "
        f"{ceiling:.2f}× (afterwards' rollout over its longer phase)"
    )
    print(
        f"  one execution: bare subprocess {overhead['bare'] * 1e3:.1f} ms, sandbox {overhead['sandbox'] * 1e3:.1f} "
        f"ms (namespaces only {overhead['namespaces only'] * 1e3:.1f} ms), unisolated "
        f"{overhead['unisolated'] * 1e3:.1f} ms (sandbox overhead {result['sandbox_overhead_s'] * 1e3:.1f} ms)"
    )
    for name, figures in harness.items():
        print(
            f"  assert-style, {name}: single interpreter {figures['single'] * 1e3:.1f} ms, split "
            f"{figures['split'] * 1e3:.1f} ms per completion ({figures['ratio']:.2f}x)"
        )
    print_contest(contest)
    return result
