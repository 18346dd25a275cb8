"""What crosses between the program's process and the judge (issue 49): nothing live, by construction.

A hostile round found four ways a wrong program still reached a reward of 1.0 through the split harness, each with a
wrong program here, on MBPP's, AceCode's and HumanEval's layouts, every one of which must score below 1:

    a judge object as a capability   a generator, lambda or setup object a test passes, walked to the judge's frames
                                     and builtins, from which verdicts are written
    a test's unimported names        ``math.isclose`` in a row that does not import math, answered by the program's
    a returned proxy                 ``f(x).startswith(expected)`` answered by the program, which sees `expected`
    control flow across the calls    a program raising StopIteration inside ``all(map(f, xs))``: vacuously true

Each of these wrong programs scored 1.0 on every layout through the harness before issue 49's change (these tests,
run against it, fail), and each test fails again when its mechanism is taken out. Then the other half: right programs
whose values are dates, fractions, decimals, numpy arrays, namedtuples and enums, rows that import numpy, values over
16 MiB, all score 1; a row that does not compile scores 0 with its reason rather than raising (and preflight refuses
it); a broken status channel or reply fails the program and costs no more than its limits.
"""

import json
import time

import pytest
from conftest import ROOT, refused

from colograd.errors import ConfigError
from colograd.rewards import code_tests, code_wire
from colograd.rewards.code import CodeReward, check_code_rows
from colograd.rewards.code_tests import RowCompileError, judge_names, row_tests
from colograd.rewards.sandbox import Sandbox, SandboxLimits, _execution

LIMITS = SandboxLimits(wall_s=10.0, cpu_s=4, memory_mib=512)


@pytest.fixture(scope="module")
def code() -> CodeReward:
    return CodeReward(limits=LIMITS, workers=2)


def score(code: CodeReward, program: str, row: dict, log: dict | None = None) -> float:
    columns = {k: [v] for k, v in row.items()}
    extra = (lambda column, values: log.update({column: values})) if log is not None else None
    return code([f"```python\n{program}```"], **columns, log_extra=extra)[0]


def layouts(asserts: list[str], entry: str, imports: tuple[str, ...] = ()) -> dict[str, dict]:
    """The same asserts as MBPP's test_list (with `imports` as its test_imports), AceCode's test_cases, and
    HumanEval's check(candidate) with `entry` replaced by candidate."""
    body = "".join(f"    {line}\n" for test in asserts for line in test.replace(entry + "(", "candidate(").split("\n"))
    return {
        "MBPP": {"test_list": asserts, "test_imports": list(imports)},
        "AceCode": {"test_cases": ["\n".join([*imports, test]) for test in asserts]},
        "HumanEval": {"test": "\n".join(imports) + "\n\ndef check(candidate):\n" + body, "entry_point": entry},
    }


# Verdicts forged from the judge's own process: from whatever the program can reach of the judge, its builtins'
# exec, running code there that writes "ok" for every test on the judge's status pipe (descriptor 5), before the
# judge reports.
FORGE = 'import os\nfor i in range(10):\n    os.write(5, (\'{"test": %d, "outcome": "ok"}\\n\' % i).encode())\n'
WALK = f"""
FORGE = {FORGE!r}
def runners(space):
    for get in (lambda s: s["exec"], lambda s: s.exec, lambda s: s["__builtins__"]["exec"],
                lambda s: s["__builtins__"].exec):
        try:
            yield get(space)
        except Exception:
            pass
def walk(obj, steps=0):
    if steps > 4:
        return
    for where in ("f_globals", "f_builtins"):
        try:
            for run in runners(getattr(obj, where)):
                try:
                    run(FORGE)
                except Exception:
                    pass
        except Exception:
            pass
    for name in ("gi_frame", "f_back", "__self__", "__globals__", "weight"):
        try:
            walk(getattr(obj, name), steps + 1)
        except Exception:
            pass
"""

HOSTILE = {
    "a judge object as a capability": (
        layouts(
            ["assert total(x for x in [1, 2, 3]) == 6", "assert total(v * 2 for v in range(3)) == 6",
             "assert apply(lambda v: v + 1, 4) == 5", "assert weigh(Box(3)) == 3"],
            "total",
        ),
        "Box",  # the setup class (MBPP's test_setup_code; the others define it in the test)
        WALK + """
def total(xs):
    walk(xs)
    return 0
def apply(f, x):
    walk(f)
    return 0
def weigh(box):
    walk(box)
    return 0
""",
    ),
    "a test's unimported names": (
        layouts(["assert math.isclose(area(1), 3.14159, rel_tol=1e-5)",
                 "assert math.isclose(area(2), 12.56637, rel_tol=1e-5)",
                 "assert np.isclose(area(3), 28.27431, rtol=1e-5)"], "area"),
        None,
        """
class _Yes:
    def __getattr__(self, name):
        return lambda *a, **k: True
math = np = _Yes()
def area(r):
    return 0
""",
    ),
    "a returned proxy": (
        layouts(["assert shout('abc').startswith('CB')", "assert shout('abc').isupper()",
                 "assert shout('xy').endswith('X!')", "assert letters('abc').issubset({'a', 'b', 'c'})"], "shout"),
        None,
        """
class Proxy:
    def __getattr__(self, name):
        return lambda *a, **k: True
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__
def shout(s):
    return Proxy()
letters = shout
""",
    ),
    "control flow across the calls": (
        layouts(["assert all(map(is_even, [2, 4, 6]))", "assert not any(map(is_even, [1, 3, 5]))",
                 "assert list(filter(is_even, [1, 2, 3, 4])) == [2, 4] or all(map(is_even, [7]))"], "is_even"),
        None,
        "def is_even(n):\n    raise StopIteration\n",
    ),
}  # fmt: skip
RIGHT = {
    "a judge object as a capability": (
        "def total(xs):\n    return sum(xs)\ndef apply(f, x):\n    return f(x)\ndef weigh(box):\n"
        "    return box.weight\n"
    ),
    "a test's unimported names": "import math\ndef area(r):\n    return math.pi * r * r\n",
    "a returned proxy": "def shout(s):\n    return s[::-1].upper() + '!'\ndef letters(s):\n    return set(s)\n",
    "control flow across the calls": "def is_even(n):\n    return n % 2 == 0\n",
}
BOX = "class Box:\n    def __init__(self, weight):\n        self.weight = weight\n"


def hostile_row(case: str, layout: str) -> dict:
    rows, setup, _ = HOSTILE[case]
    row = dict(rows[layout])
    if setup == "Box":  # the setup's class: MBPP's setup code; AceCode's and HumanEval's define it in the test
        if layout == "MBPP":
            row["test_setup_code"] = BOX
        elif layout == "AceCode":
            row["test_cases"] = [BOX + test for test in row["test_cases"]]
        else:
            row["test"] = BOX + row["test"]
    return row


@pytest.mark.parametrize("layout", ["MBPP", "AceCode", "HumanEval"])
@pytest.mark.parametrize("case", HOSTILE)
def test_a_right_program_scores_one(code, case, layout):
    log: dict = {}
    assert score(code, RIGHT[case], hostile_row(case, layout), log) == 1.0, log


@pytest.mark.parametrize("layout", ["MBPP", "AceCode", "HumanEval"])
@pytest.mark.parametrize("case", HOSTILE)
def test_a_wrong_program_scores_below_one(code, case, layout):
    log: dict = {}
    assert score(code, HOSTILE[case][2], hostile_row(case, layout), log) < 1.0, log


def test_the_failure_names_what_was_refused(code):
    log: dict = {}
    score(code, HOSTILE["a returned proxy"][2], hostile_row("a returned proxy", "MBPP"), log)
    assert log["code_failure"] == ["not plain data: Proxy.startswith"]
    score(code, HOSTILE["control flow across the calls"][2], hostile_row("control flow across the calls", "MBPP"), log)
    assert log["code_failure"] == ["error: StopIteration (raised by is_even)"]
    row = {"test_list": ["assert area(1) > eval('undefined_name')"]}  # a name no analysis sees: the judge's NameError
    score(code, RIGHT["a test's unimported names"], row, log)
    assert log["code_failure"][0].startswith("error: NameError (undefined_name is neither")


@pytest.mark.parametrize("name", ["StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt"])
def test_a_control_flow_exception_fails_the_test_whatever_catches_it(code, name):
    row = {"test_list": ["try:\n    f(1)\nexcept BaseException:\n    pass\nassert True or f(2)\nassert f(0) == 0"]}
    assert score(code, f"def f(x):\n    if x:\n        raise {name}\n    return 0\n", row) == 0.0
    assert score(code, "def f(x):\n    if x:\n        raise ValueError\n    return 0\n", row) == 1.0


# --- right programs score 1 ------------------------------------------------------------------------------------------

VALUES = {
    "dates and times": (
        {"test_list": ["assert next_day(datetime.date(2024, 2, 28)) == datetime.date(2024, 2, 29)",
                       "assert next_day(datetime.date(2023, 12, 31)).year == 2024",
                       "assert span(datetime.datetime(2024, 1, 1, 12)) == datetime.timedelta(hours=12)",
                       "assert str(next_day(datetime.date(2024, 1, 9))) == '2024-01-10'"],
         "test_imports": ["import datetime"]},
        "import datetime\ndef next_day(d):\n    return d + datetime.timedelta(days=1)\n"
        "def span(t):\n    return t - datetime.datetime(2024, 1, 1)\n",
    ),
    "Fraction and Decimal": (
        {"test_cases": ["from fractions import Fraction\nassert half(3) == Fraction(3, 2)",
                        "from decimal import Decimal\nassert price('1.10') == Decimal('2.20')",
                        "assert half(1).denominator == 2"]},
        "from fractions import Fraction\nfrom decimal import Decimal\ndef half(n):\n    return Fraction(n, 2)\n"
        "def price(s):\n    return Decimal(s) * 2\n",
    ),
    "numpy arrays and scalars, a row that imports numpy": (
        {"test_list": ["assert np.array_equal(double(np.array([[1, 2], [3, 4]])), np.array([[2, 4], [6, 8]]))",
                       "assert double(np.arange(3)).dtype == np.arange(3).dtype",
                       "assert np.isclose(mean(np.array([1.0, 2.0])), 1.5)",
                       "assert isinstance(mean(np.array([1.0])), np.floating)"],
         "test_imports": ["import numpy as np"]},
        "import numpy as np\ndef double(a):\n    return a * 2\ndef mean(a):\n    return a.mean()\n",
    ),
    "namedtuples, enums, Counters, defaultdicts, generators": (
        {"test_list": ["assert point().x == 1 and point() == (1, 2)",
                       "assert colour().name == 'RED' and colour() == 1",
                       "assert counts('aab')['z'] == 0 and counts('aab') == {'a': 2, 'b': 1}",
                       "assert groups()['new'] == [] and list(squares(3)) == [0, 1, 4]",
                       "assert next(naturals()) == 0 and sum(x for _, x in zip(range(5), naturals())) == 10"]},
        "import collections, enum, itertools\nP = collections.namedtuple('P', 'x y')\n"
        "def point():\n    return P(1, 2)\nclass Colour(enum.IntEnum):\n    RED = 1\n"
        "def colour():\n    return Colour.RED\n"
        "def counts(s):\n    return collections.Counter(s)\ndef groups():\n    return collections.defaultdict(list)\n"
        "def squares(n):\n    return (i * i for i in range(n))\ndef naturals():\n    return itertools.count()\n",
    ),
    "a value over 16 MiB": (
        {"test_list": ["assert len(big(20 << 20)) == 20 << 20", "assert big(3) == 'aaa'"]},
        "def big(n):\n    return 'a' * n\n",
    ),
    "exceptions with their messages": (
        {"test_list": [
            "try:\n    f(-1)\nexcept ValueError as err:\n    assert str(err) == 'negative'\nelse:\n    assert False",
            "try:\n    g({}, 'k')\nexcept KeyError as err:\n    assert err.args == ('k',) and str(err) == \"'k'\"",
            "try:\n    h(b'\\xff')\nexcept UnicodeDecodeError as err:\n    assert err.start == 0\n"
            "else:\n    assert False",
        ]},
        "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\ndef g(d, k):\n    return d[k]\n"
        "def h(b):\n    return b.decode('utf-8')\n",
    ),
    "a function returned, methods of a named class": (
        {"test_list": ["assert adder(2)(3) == 5", "assert Stack().push(1).push(2).items == [1, 2]",
                       "assert Stack().push('ab').top().startswith('a')",
                       "assert isinstance(Stack().push(1), Stack)"],
         "code": "class Stack:\n    pass"},
        "def adder(n):\n    return lambda x: x + n\nclass Stack:\n    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n        return self\n    def top(self):\n"
        "        return self.items[-1]\n",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", VALUES)
def test_right_programs_with_library_values_score_one(code, case):
    row, program = VALUES[case]
    log: dict = {}
    assert score(code, program, row, log) == 1.0, log


def test_library_values_are_rebuilt_as_the_receivers_own():
    import datetime
    from collections import Counter, namedtuple
    from decimal import Decimal
    from fractions import Fraction

    import numpy as np

    def refuse(tag, items, depth):
        raise code_wire.ProgramGone("malformed reply")

    P = namedtuple("P", "x y")
    for value in (datetime.date(2024, 2, 29), datetime.datetime(2024, 1, 1, 3, 4, 5), datetime.timedelta(days=2),
                  Fraction(3, 7), Decimal("1.10"), P(1, 2), Counter("aab"), np.arange(6).reshape(2, 3),
                  np.float32(1.5)):  # fmt: skip
        back = code_wire.decode(code_wire.encode(value), refuse)
        assert type(back).__name__ == type(value).__name__ and (
            np.array_equal(back, value) if isinstance(value, np.ndarray) else back == value
        )
        if isinstance(value, tuple):
            assert type(back) is not type(value)  # a fresh type of the receiver's, not the sender's class
    for data in (["ndarray", "|O", [1], "00" * 8], ["ndarray", "<i8", [2], "00" * 8], ["enum", "E", "Nope", "A"],
                 ["nt", "P", ["__class__"], 1], ["date", "2024-13-01"], ["fraction", 1, 0]):  # fmt: skip
        with pytest.raises(code_wire.ProgramGone):
            code_wire.decode(data, refuse)


def test_a_tests_names_resolve_in_the_judge_unless_the_row_makes_them_the_programs():
    row = {"test_cases": ["assert math.isclose(area(1), 3.14)", "assert Shape(2).area() == np.pi * 4"]}
    names = judge_names(row_tests({**row, "question": "Write a class Shape with an area method, and area(r)."}))
    assert names.program == ("Shape", "area") and names.classes == ("Shape",)
    # A class is one the row declares (its text, reference solution or setup), never a name's spelling.
    assert judge_names(row_tests(row)).classes == ()
    assert judge_names(row_tests({**row, "test_setup_code": "class Shape:\n    pass"})).classes == ()  # the setup's
    assert judge_names(row_tests({**row, "solution": "class Shape:\n    def area(self): ..."})).classes == ("Shape",)
    assert names.modules == {"math": "math", "np": "numpy"}
    called = judge_names(row_tests({"test_list": ["assert random(3) == 4"]}))
    assert called.program == ("random",) and called.modules == {}  # a module's name called: the program's function


# --- rows and channels that do not hold ------------------------------------------------------------------------------


def test_a_row_that_does_not_compile_scores_zero_and_preflight_names_it(code):
    row = {"test_list": ["nonlocal x\nassert add(1, 2) == 3"]}
    with pytest.raises(RowCompileError, match="test_list item 0 does not compile"):
        row_tests(row)
    log: dict = {}
    assert score(code, "def add(a, b):\n    return a + b\n", row, log) == 0.0
    assert log["code_failure"][0].startswith("row: test_list item 0 does not compile as Python (SyntaxError")
    rows = [{"test_list": ["assert add(1, 2) == 3"]}, row]
    with pytest.raises(ConfigError) as err:
        check_code_rows([code], ["test_list"], lambda names: {c: [r[c] for r in rows] for c in names}, "data")
    assert str(err.value).startswith("reward function 'code': dataset 'data' row 1: test_list item 0 does not compile")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "status",
    [b"not json\n", b'{"test": "0", "outcome": "ok"}\n', b'{"test": 0, "outcome": 1}\n', b"[1]\n", b"{}\n",
     b'{"test": 99, "outcome": "ok"}\n', b'{"program": "x", "protections": 3}\n', b"[" * 100_000 + b"\n",
     b"\n" * (2 << 20)],
)  # fmt: skip
def test_a_status_line_out_of_shape_fails_the_program_never_the_reward(status):
    start = time.perf_counter()
    execution = _execution(b"", b"", status, None, 0, 0.0, tests=2)
    assert time.perf_counter() - start < 2.0
    assert execution.verdicts.get(0) != "ok" and not execution.ok


def test_a_status_channel_without_end_costs_no_more_than_the_programs_limits():
    # A judge (compromised, or broken) that writes 64 MiB of blank lines and then hangs: cut at the status cap.
    sandbox = Sandbox(SandboxLimits(wall_s=5.0, cpu_s=2, memory_mib=256))
    flood = (
        "import os\ndef judge(job, r, w, report):\n    for _ in range(64):\n        os.write(5, b'\\n' * (1 << 20))\n"
    )
    harness = compile(flood, "flood", "exec")
    import marshal

    job = {"harness": marshal.dumps([("flood", harness)]).hex(), "imports": "", "setup": "", "tests": ["assert f()"],
           "program": ["f"], "modules": {}, "classes": []}  # fmt: skip
    start = time.perf_counter()
    execution = sandbox.run("import time\ntime.sleep(30)\n", judge=job)
    assert time.perf_counter() - start < 10 and execution.reason == "status limit" and not execution.verdicts


def test_a_message_over_the_cap_fails_the_program(code):
    row = {"test_list": ["assert len(big()) == 1"]}
    log: dict = {}
    assert score(code, f"def big():\n    return 'a' * {code_wire.MAX_MESSAGE + 1}\n", row, log) == 0.0
    assert log["code_failure"] == ["output limit"]
    forged = "import os\ndef big():\n    os.write(4, (5).to_bytes(4, 'big') + b'{\"x\"}')\n    return 1\n"
    assert score(code, forged, row, log) == 0.0 and log["code_failure"] == ["malformed reply"]


def test_judge_job_carries_the_names(monkeypatch):
    job = code_tests.judge_job(row_tests({"test_list": ["assert add(1, 2) == 3"]}), Sandbox(LIMITS).python)
    assert job["program"] == ["add"] and job["modules"] == {} and json.dumps(job)


def test_a_builtin_that_runs_data_as_code_is_never_handed_to_the_program(code):
    row = {"test_list": ["assert apply(eval, '1 + 1') == 2", "assert apply(len, 'ab') == 2"]}
    log: dict = {}
    assert score(code, "def apply(f, x):\n    return f(x)\n", row, log) == 0.5
    assert log["code_failure"] == ["not plain data: eval (a builtin the program may not call in the judge)"]


def test_the_run_refuses_a_row_that_does_not_compile_before_it_loads_weights(tmp_path):
    rows = [{"prompt": f"{i}+1=", "test_list": [f"assert add({i}, 1) == {i + 1}"]} for i in range(8)]
    rows[2]["test_list"] = ["nonlocal x\nassert add(2, 1) == 3"]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    message = refused("--config", str(ROOT / "recipes/grpo_tiny.yaml"), "--dataset_name", str(data),
                      "--reward_funcs", "code", "--output_dir", str(tmp_path / "out"))  # fmt: skip
    assert "row 2: test_list item 0 does not compile as Python (SyntaxError" in message and "\n" not in message


# Values one interpreter compares that used to fail as not plain data (a correct program's false negative): each
# row's test compares the program's result as a test would, and a program returning another value fails it.
VALUE_TYPES = {
    "bytearray": ("bytearray(b'ab')", "assert f() == bytearray(b'ab') and f() == b'ab'", "bytearray(b'ac')"),
    "memoryview": ("memoryview(b'ab')", "assert f() == b'ab'", "memoryview(b'ac')"),
    "dict keys": ("{'a': 1, 'b': 2}.keys()", "assert f() == {'a', 'b'}", "{'a': 1}.keys()"),
    "dict values": ("{'a': 1, 'b': 2}.values()", "assert sorted(f()) == [1, 2]", "{'a': 1}.values()"),
    "dict items": ("{'a': 1}.items()", "assert f() == {('a', 1)}", "{'a': 2}.items()"),
    "deque": ("__import__('collections').deque([1, 2])", "import collections\nassert f() == collections.deque([1, 2])",
              "__import__('collections').deque([2, 1])"),
    "ChainMap": ("__import__('collections').ChainMap({'a': 1}, {'b': 2})", "assert f() == {'a': 1, 'b': 2}",
                 "__import__('collections').ChainMap({'a': 1})"),
    "array": ("__import__('array').array('i', [1, 2])", "import array\nassert f() == array.array('i', [1, 2])",
              "__import__('array').array('i', [1, 3])"),
}  # fmt: skip


@pytest.mark.parametrize("kind", VALUE_TYPES)
def test_the_value_types_one_interpreter_compares_cross_as_data(code, kind):
    right, test, wrong = VALUE_TYPES[kind]
    row = {"test_list": [test]}
    assert score(code, f"def f():\n    return {right}\n", row) == 1.0
    assert score(code, f"def f():\n    return {wrong}\n", row) == 0.0


GRAPHS = """
class Node:
    def __init__(self, val, next=None):
        self.val, self.next = val, next
head = None
for v in range(4999, -1, -1):
    head = Node(v, head)
a, b, c = Node(1), Node(2), Node(3)
a.next, b.next, c.next = b, c, a
hub = Node(0, [a, b, c])
a.hub = b.hub = c.hub = hub
"""
WALKS = """
def length(node):
    n = 0
    while node is not None:
        n, node = n + 1, node.next
    return n

def ring(node):
    seen = []
    while all(node is not s for s in seen):
        seen.append(node)
        node = node.next
    return len(seen)

def find(node, val):
    while node.val != val:
        node = node.next
    return node
"""


NESTS = "def nest(n):\n    x = []\n    for _ in range(n):\n        x = [x]\n    return x\n"


def test_nested_data_crosses_as_deep_as_one_interpreter_compares_it(code):
    """Lists nested 900 deep cross and compare (they were refused past 200: a right answer scored 0); 1,100 deep, one
    interpreter's comparison runs out of recursion, and the test fails here too."""
    reference = NESTS.replace("def nest", "def reference")
    row = {"test_list": ["assert nest(900) == reference(900)"], "test_setup_code": reference}
    log = {}
    assert score(code, NESTS, row, log) == 1.0, log
    assert score(code, NESTS.replace("x = [x]", "x = [x, 0]"), row) == 0.0
    too_deep = {"test_list": ["assert nest(1100) == reference(1100)"], "test_setup_code": reference}
    assert score(code, NESTS, too_deep) == 0.0


def test_object_graphs_with_cycles_and_long_lists_cross_by_identity(code):
    # Issue 62: a test's linked list of over ~100 nodes, or a graph with a cycle, failed as "nested too deep", so a
    # correct program scored 0. The test's objects cross as one flat graph: a cycle is a reference to a node already
    # copied, a 5,000-node list is as deep as one node, and a node the program hands back is the test's own.
    tests = ["assert length(head) == 5000", "assert ring(a) == 3", "assert find(a, 3) is c",
             "assert find(head, 4999).next is None", "assert ring(hub.next[1].hub.next[2]) == 3",
             "assert find(c, 2).hub is hub"]  # fmt: skip
    row = {"test_list": tests, "test_setup_code": GRAPHS}
    log = {}
    assert score(code, WALKS, row, log) == 1.0, log
    assert score(code, WALKS.replace("n + 1, node.next", "n + 2, node.next"), row) < 1.0
    assert score(code, WALKS.replace("return node\n", "return node.next\n"), row) < 1.0
