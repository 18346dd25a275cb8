"""open-r1's `cf_code` in colograd's sandbox: its arithmetic and its output comparison held against open-r1's own
code (tests/rewards/open_r1_cf_reference.py), and real programs, C++ and Python, judged on contest-shaped rows."""

import asyncio
import json
import os
import socket
import subprocess
import threading
from pathlib import Path

import open_r1_cf_reference as reference
import pytest

from colograd.errors import ConfigError
from colograd.rewards import code_codeforces as cf
from colograd.rewards.code_codeforces import CfCodeReward, normalize_output, submission_score, tally

MODES = ("pass_fail", "partial", "weighted_sum")
SANDBOX = os.environ.get("COLOGRAD_TEST_SANDBOX", "namespaces")


# --- the arithmetic, against open-r1's score_submission ------------------------------------------------------------


def open_r1(verdicts, mode, batch, code="int main(){}", compiles=True, generated=0):
    """open-r1's score_submission on a problem whose tests pass as `verdicts` say, Piston replaced by a stand-in."""

    async def single(client, problem, test_input, test_output, submission, language):
        return {"compile": {"code": 0 if compiles else 1}, "run": {"code": 0, "stdout": test_output}}

    async def generated_tests(problem_id):
        return [{"input": "", "output": "1" if v else "0"} for v in verdicts[len(verdicts) - generated :]]

    official = [{"input": "", "output": "1" if v else "0"} for v in verdicts[: len(verdicts) - generated]]
    reference.score_single_test_case, reference.get_generated_tests = single, generated_tests
    problem = {"id": "1/A", "official_tests": official}
    return asyncio.run(reference.score_submission(None, problem, code, batch, mode, submission_language="cpp"))


def colograd(verdicts, mode, code="int main(){}", compiles=True):
    passed, _ = tally((None if v else "wrong answer" for v in verdicts), mode)
    return submission_score(code, len(verdicts), compiles, passed, mode)


CASES = [[True] * 3, [True, False, True], [False] * 4, [True, True, True, False], [False, True], [True], [False], []]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch", [1, 2, -1])
def test_the_score_is_open_r1s_for_every_mode_and_batch(mode, batch):
    for verdicts in CASES:
        for generated in {0, len(verdicts) // 2}:
            want = open_r1(verdicts, mode, batch, generated=generated)
            assert (
                colograd(verdicts, mode) == pytest.approx(want)
                if want is not None
                else colograd(verdicts, mode) is None
            ), (verdicts, mode, batch)
        assert colograd(verdicts, mode, code="") == open_r1(verdicts, mode, batch, code="")  # no code: -1, or None
        assert colograd(verdicts, mode, compiles=False) == open_r1(verdicts, mode, batch, compiles=False)
    assert colograd([True, False], "weighted_sum") == pytest.approx(0.05)  # by hand: 0 + 0.1 × 1/2
    assert colograd([True, True], "weighted_sum") == pytest.approx(1.1)


OUTPUTS = [
    ("1 2 3\n", "1 2 3"), ("1 2 3\n", "1\n2\n3\n\n"), ("1  2\t3", "1 2 3"), ("yes\n", "YES"), ("Yes no", "YES NO"),
    ("yes", "yess"), ("yesno", "YESNO"), ("yes_1", "YES_1"), ("no.", "NO."), ("12", "1 2"), ("1 2", "1 3"),
    ("a\r\nb\r\n", "a b"), ("", "\n\n"), ("", "0"), ("x\x0by", "x y"), ("Nope", "NOPE"), (" 1", "1 "),
]  # fmt: skip


def test_the_comparison_is_the_piston_packages(tmp_path):
    script = reference.NORMALIZE_OUTPUT + 'diff -bq <(normalize_output "$1") <(normalize_output "$2") >/dev/null'
    for a, b in OUTPUTS:
        (tmp_path / "a").write_text(a)
        (tmp_path / "b").write_text(b)
        piston = subprocess.run(["bash", "-c", script, "x", tmp_path / "a", tmp_path / "b"],
                                env={"LC_ALL": "C", "PATH": os.environ["PATH"]}).returncode == 0  # fmt: skip
        assert (normalize_output(a) == normalize_output(b)) == piston, (a, b)


# --- real programs in the sandbox ----------------------------------------------------------------------------------

SUM = '#include <cstdio>\nint main(){long long a,b;scanf("%lld %lld",&a,&b);printf("%lld\\n",a+b);}\n'
# Wrong when a + b overflows an int (the third test).
SUM_INT = '#include <cstdio>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);}\n'
# Right, and never ends on its third test.
SUM_SLOW = SUM.replace("int main(){", "int main(){volatile long long s=0;").replace(
    "printf", "if(a>1000000)for(;;)s++;printf"
)
SUM_PY = "a, b = map(int, input().split())\nprint(a + b)\n"
SUM_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\r\n", "output": "12\n"},
             {"input": "2000000000 2000000000\n", "output": "4000000000\n"}]  # fmt: skip


def row(tests=SUM_TESTS, language="cpp", checker=None, time_limit=1.0, memory_limit=256, input_mode="stdio", **more):
    return {"id": "9999/A", "language": language, "official_tests": tests, "generated_checker": checker,
            "time_limit": time_limit, "memory_limit": memory_limit, "input_mode": input_mode, **more}  # fmt: skip


def block(code: str, language: str = "cpp") -> list[dict]:
    return [{"role": "assistant", "content": f"Here:\n```{language}\n{code}```\n"}]


def judge(reward, programs, r):
    completions = [p if isinstance(p, list) else block(p, r["language"]) for p in programs]
    return reward(completions, **{k: [v] * len(programs) for k, v in r.items()})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cf_tests"))


@pytest.fixture(scope="module")
def rewards(folder):
    return {mode: CfCodeReward(scoring_mode=mode, sandbox=SANDBOX, workers=2, tests_folder=folder) for mode in MODES}


def test_a_cpp_program_is_scored_by_each_mode(rewards):
    programs = [SUM, SUM_INT, SUM_SLOW, "int main() { return 0 }", [{"role": "assistant", "content": "no code"}]]
    assert judge(rewards["pass_fail"], programs, row()) == [1.0, 0.0, 0.0, -0.1, -1.0]
    assert judge(rewards["partial"], programs, row()) == pytest.approx([1.0, 2 / 3, 2 / 3, -0.1, -1.0])
    assert judge(rewards["weighted_sum"], programs, row()) == pytest.approx([1.1, 0.2 / 3, 0.2 / 3, -0.1, -1.0])


def test_a_python_row_runs_python_and_a_row_without_tests_gets_no_reward(rewards):
    wrong = SUM_PY.replace("a + b", "a - b")
    assert judge(rewards["partial"], [SUM_PY, wrong], row(language="python")) == pytest.approx([1.0, 0.0])
    assert judge(rewards["partial"], [SUM_PY], row(tests=[], language="python")) == [None]  # open-r1's


def test_the_time_limit_is_the_rows(rewards):
    # 0.4 s of work: within a 2 s limit, over a 0.1 s one.
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4:\n    pass\nprint(3)\n"
    tests = SUM_TESTS[:1]
    assert judge(rewards["partial"], [busy], row(tests, "python", time_limit=2.0)) == [1.0]
    assert judge(rewards["partial"], [busy], row(tests, "python", time_limit=0.1)) == [0.0]


DERANGE = """
import sys
n = int(open(sys.argv[1]).read())
words = open(sys.argv[3]).read().split()
ok = len(words) == n and sorted(words, key=int) == [str(i) for i in range(1, n + 1)]
print({yes} if ok and all(int(w) != i + 1 for i, w in enumerate(words)) else 0)
"""
ROTATE = '#include <cstdio>\nint main(){int n;scanf("%d",&n);printf("%d",n);for(int i=1;i<n;i++)printf(" %d",i);}\n'
IDENTITY = '#include <cstdio>\nint main(){int n;scanf("%d",&n);for(int i=1;i<=n;i++)printf("%d ",i);}\n'
DERANGE_TESTS = [{"input": f"{n}\n", "output": " ".join(map(str, [*range(2, n + 1), 1])) + "\n"} for n in (3, 4, 5)]


@pytest.mark.parametrize("yes", ["1", "100"])
def test_an_any_answer_problem_is_scored_by_its_checker(rewards, yes):
    checked = row(DERANGE_TESTS, checker=DERANGE.format(yes=yes))
    assert judge(rewards["partial"], [ROTATE, IDENTITY], checked) == [1.0, 0.0]
    assert judge(rewards["partial"], [ROTATE], row(DERANGE_TESTS)) == [0.0]  # the expected output differs


def test_a_checker_that_says_1_but_fails_rejects(rewards):
    checker = "print(1)\nraise SystemExit(1)\n"  # the run script passes the checker's exit status on
    assert judge(rewards["partial"], [ROTATE], row(DERANGE_TESTS, checker=checker)) == [0.0]


def test_file_input_mode_reads_input_txt_and_writes_output_txt(rewards):
    files = ('#include <cstdio>\nint main(){long long a,b;FILE*i=fopen("input.txt","r");FILE*o=fopen("output.txt",'
             '"w");fscanf(i,"%lld %lld",&a,&b);fprintf(o,"%lld\\n",a+b);printf("noise\\n");}\n')  # fmt: skip
    assert judge(rewards["partial"], [files, SUM], row(input_mode="file")) == [1.0, 0.0]


def test_the_stack_is_as_large_as_the_memory(rewards):
    # 300000 nested calls of ~250 bytes each (a local array read after the call: no loop can replace them), ~75 MB
    # of stack: a runtime error under the usual 8 MB, within the 256 MB of memory (Codeforces' and Piston's stack).
    deep = ("#include <cstdio>\nlong long f(long long n){volatile char pad[200];pad[n%200]=1;if(!n)return 0;"
            "long long r=f(n-1);return r+pad[n%200];}\nint main(){printf(\"%lld\\n\",f(300000));}\n")  # fmt: skip
    tests = [{"input": "", "output": "300000\n"}]
    assert judge(rewards["partial"], [deep], row(tests)) == [1.0]


def test_generated_tests_are_read_from_the_folder(folder, rewards, monkeypatch):
    monkeypatch.setattr(cf, "_contest_tests", lambda path: {"9999/A": (("40 2\n", "42\n"),)} if
                        path.endswith("test_cases_9999.parquet") else {})  # fmt: skip
    wrong_on_generated = SUM.replace("a+b", "a+b+(a==40)")
    assert judge(rewards["partial"], [wrong_on_generated], row()) == pytest.approx([0.75])


def test_a_generated_tests_parquet_is_grouped_by_problem(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    table = pyarrow.table({"problem_id": ["12/A", "12/B", "12/A"], "input": ["1", "2", "3"],
                           "output": ["a", "b", "c"]})  # fmt: skip
    pq.write_table(table, tmp_path / "test_cases_0012.parquet")
    assert cf.generated_tests(str(tmp_path), "12/A") == (("1", "a"), ("3", "c"))
    assert cf.generated_tests(str(tmp_path), "13/A") == ()


def test_a_program_sees_no_trainer_file_environment_or_network(rewards, tmp_path, monkeypatch):
    """The expected output is the secret; the program passes only if one of the three leaks it. The same program
    outside the sandbox (`sandbox="none"`) passes: the test can fail."""
    secret = "colograd_cf_secret_1234"
    path = tmp_path / "token"
    path.write_text(secret)
    monkeypatch.setenv("COLOGRAD_CF_SECRET", secret)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]

    def serve():
        for _ in range(4):
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(secret.encode() + b"\n")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    reads = {
        "file": f'#include <cstdio>\nint main(){{char b[64]={{0}};FILE*f=fopen("{path}","r");if(f)fscanf(f,"%63s",b);'
        'printf("%s\\n",b);}\n',
        "environment": '#include <cstdio>\n#include <cstdlib>\nint main(){const char*s=getenv("COLOGRAD_CF_SECRET");'
        'printf("%s\\n",s?s:"none");}\n',
        "network": "#include <cstdio>\n#include <sys/socket.h>\n#include <netinet/in.h>\n#include <arpa/inet.h>\n"
        "#include <unistd.h>\nint main(){int s=socket(AF_INET,SOCK_STREAM,0);sockaddr_in a{};a.sin_family=AF_INET;"
        f'a.sin_port=htons({port});inet_pton(AF_INET,"127.0.0.1",&a.sin_addr);char b[64]={{0}};'
        'if(connect(s,(sockaddr*)&a,sizeof a)==0)read(s,b,63);printf("%s",b[0]?b:"none\\n");}\n',
    }
    tests = [{"input": "", "output": secret + "\n"}]
    try:
        if SANDBOX == "namespaces":
            assert judge(rewards["partial"], list(reads.values()), row(tests)) == [0.0, 0.0, 0.0]
        open_reward = CfCodeReward(scoring_mode="partial", sandbox="none", workers=1, tests_folder=str(tmp_path))
        assert judge(open_reward, list(reads.values()), row(tests)) == [1.0, 1.0, 1.0]
    finally:
        server.close()


def test_the_reward_refuses_what_it_cannot_judge_in_one_line(folder, rewards, monkeypatch):
    monkeypatch.delenv("CF_TESTS_FOLDER", raising=False)
    with pytest.raises(ConfigError, match="cf_code: CF_TESTS_FOLDER is not set; open-r1's cf_code reads") as err:
        CfCodeReward()
    with pytest.raises(ConfigError, match="does not exist"):
        CfCodeReward(tests_folder=folder + "/missing")
    with pytest.raises(ConfigError, match="code_eval_scoring_mode: 'binary'"):
        CfCodeReward(scoring_mode="binary", tests_folder=folder)
    with pytest.raises(ConfigError, match="a row's language is 'java'; give python or cpp"):
        judge(rewards["partial"], [SUM], row(language="java"))
    no_checker = {k: v for k, v in row().items() if k != "generated_checker"}
    with pytest.raises(ConfigError, match="the rows lack generated_checker"):
        judge(rewards["partial"], [SUM], no_checker)
    assert "\n" not in str(err.value)


SAMPLE = Path(os.environ.get("COLOGRAD_CONTEST_SAMPLE", Path(__file__).parent / "contest" / "sample.jsonl"))
CF_ROWS = [r for r in map(json.loads, SAMPLE.read_text().splitlines()) if "generated_checker" in r]


@pytest.mark.parametrize("r", CF_ROWS, ids=lambda r: r["id"])
def test_open_r1_codeforces_rows_score_their_right_solutions_1_and_wrong_ones_0(rewards, r):
    """The contest sample's open-r1/codeforces rows (tests/rewards/contest/; real ones with
    ``COLOGRAD_CONTEST_SAMPLE``): each right Python solution passes every test, each wrong one fails."""
    right, wrong = r["colograd_solutions"]["right"], r["colograd_solutions"]["wrong"]
    given = {"language": "python", **{k: v for k, v in r.items() if k in cf.COLUMNS}}
    # What is tested is the judging of the answers (the time limit has its test above): a right Python program under
    # the row's 1 s of wall time timed out 2 times in 48 at a load of 9 on the 2 cores (an interpreter's start slowed
    # by what the clock does not deduct), a verdict the machine's load would decide.
    given["time_limit"] = max(given["time_limit"], 5.0)
    assert judge(rewards["pass_fail"], right + wrong, given) == [1.0] * len(right) + [0.0] * len(wrong)


def test_rows_cf_code_cannot_judge_are_refused_before_the_run(rewards):
    good = row()
    columns = {c: [good[c], good[c]] for c in cf.COLUMNS}
    read = lambda names: {c: columns[c] for c in names}  # noqa: E731
    cf.check_cf_rows([rewards["partial"]], list(columns), read, "cf")  # every row readable
    columns["language"] = ["cpp", "kotlin"]
    with pytest.raises(ConfigError, match="^reward function 'cf_code': dataset 'cf' row 1: a row's language is "):
        cf.check_cf_rows([rewards["partial"]], list(columns), read, "cf")
    cf.check_cf_rows([lambda completions, **kw: [0.0]], list(columns), read, "cf")  # no cf_code: nothing read
    columns["language"] = ["cpp", "cpp"]
    columns["official_tests"] = [SUM_TESTS, "not json"]
    with pytest.raises(ConfigError, match="row 1: a row's official_tests are not a list"):
        cf.check_cf_rows([rewards["partial"]], list(columns), read, "cf")
    with pytest.raises(ConfigError, match="dataset 'cf' lacks generated_checker"):
        cf.check_cf_rows([rewards["partial"]], [c for c in columns if c != "generated_checker"], read, "cf")


def test_a_test_the_machine_starved_runs_again_and_at_every_try_gets_no_reward(folder, monkeypatch, caplog):
    """cf_code as `code` (tests/rewards/test_code_cases.py): a test stopped as "overloaded" (the machine's verdict)
    runs again in a fresh sandbox; starved at every try, the completion gets no reward (None), never a score."""
    from test_code_cases import starved

    from colograd.rewards.sandbox_session import OVERLOADED_TRIES

    reward = CfCodeReward(scoring_mode="partial", sandbox=SANDBOX, workers=1, tests_folder=folder)
    slow = "import time\ntime.sleep(0.5)\n" + SUM_PY  # still running at the clock's first check
    r = row(tests=SUM_TESTS[:1], language="python", time_limit=5.0)
    given = starved(monkeypatch, 2)
    assert judge(reward, [slow], r) == [1.0] and len(given) == 2
    given = starved(monkeypatch, 100)
    assert judge(reward, [slow], r) == [None] and len(given) == OVERLOADED_TRIES
    assert "stopped as overloaded 3 times in a row" in caplog.text


def test_a_checker_the_machine_starved_runs_again_and_never_reads_as_a_wrong_answer(rewards, monkeypatch):
    """cf_code's checker as `code`'s (tests/rewards/test_code_checkers.py): a checker execution stopped as
    "overloaded" runs again; a right answer starved twice there scores 1.0, and starved at every try the completion
    gets no reward (None), not "wrong answer (checker)" as before."""
    from test_code_checkers import checker_starved

    checked = row(DERANGE_TESTS, checker=DERANGE.format(yes="1"))
    replaced = checker_starved(monkeypatch, 2)
    assert judge(rewards["partial"], [ROTATE], checked) == [1.0] and len(replaced) == 2
    checker_starved(monkeypatch, 100)
    assert judge(rewards["partial"], [ROTATE], checked) == [None]
