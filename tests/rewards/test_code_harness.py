"""The split harness (`colograd.rewards.code_harness`): what crosses between the program's process and the judge,
worked by
hand; tests keeping their meaning when split, through the real sandbox; and the tests' expected values never
reaching the program's process."""

import math
import uuid
from collections import Counter, OrderedDict, namedtuple
from enum import IntEnum

import pytest

from colograd.rewards import code_tests, code_wire
from colograd.rewards.code_tests import row_tests, run_asserts
from colograd.rewards.code_wire import NotPlainData, ProgramGone, decode, deep_enough, encode, lenient
from colograd.rewards.sandbox import Sandbox, SandboxLimits


def no_handles(tag, key, type_name):
    raise AssertionError("no handle expected")


@pytest.mark.parametrize(
    "value, data",
    [
        (None, None), (True, True), (3, 3), (-2.5, -2.5), ("a\ud800", "a\ud800"),
        (2**60, ["int", hex(2**60)]), (-(2**60), ["int", hex(-(2**60))]),
        ([1, (2, 3)], ["list", 1, ["tuple", 2, 3]]), ({1, 2}, ["set", 1, 2]), (frozenset(), ["frozenset"]),
        ({(1, 2): "x"}, ["dict", ["tuple", 1, 2], "x"]), (b"\x00\xff", ["bytes", "00ff"]),
        (1 + 2j, ["complex", 1.0, 2.0]),
    ],
)  # fmt: skip
def test_plain_data_is_encoded_by_type_and_decoded_back(value, data):
    assert encode(value) == data
    back = decode(data, no_handles)
    assert back == value and type(back) is type(value)


def test_floats_keep_nan_infinity_and_the_sign_of_zero():
    for value in (math.inf, -math.inf, -0.0):
        assert repr(decode(encode(value), no_handles)) == repr(value)
    assert math.isnan(decode(encode(math.nan), no_handles))
    assert decode(encode(10**5000), no_handles) == 10**5000  # past str(int)'s 4300 digits


@pytest.mark.parametrize(
    "data",
    [{"a": 1}, [], [1, 2], ["list", {"a": 1}], ["set", ["list", 1]], ["dict", 1], ["int", 5], ["int", "zz"],
     ["bytes", "0"], ["complex", "1", 2], ["module", "os"], ["h", "0", "x"]],
)  # fmt: skip
def test_anything_else_is_refused_as_malformed(data):
    with pytest.raises(ProgramGone, match="malformed"):
        decode(data, lambda tag, key, name: (_ for _ in ()).throw(ProgramGone("malformed reply")))


def test_deep_nesting_is_refused_not_crashing():
    deep = ["list"]
    for _ in range(10_000):
        deep = ["list", deep]
    with pytest.raises(ProgramGone):
        decode(deep, no_handles)
    nested = []
    for _ in range(1001):  # one level past what one interpreter's comparison reaches (its recursion limit)
        nested = [nested]
    with deep_enough(), pytest.raises(NotPlainData, match="nested too deep"):
        encode(nested)
    with deep_enough():
        assert decode(encode(nested[0]), no_handles) == nested[0]  # 1,000 deep crosses


def test_the_program_side_sends_values_that_are_plain_in_all_but_type_as_plain():
    Point = namedtuple("Point", "x y")

    class Colour(IntEnum):
        RED = 1

    class Name(str):
        def __str__(self):
            return "overridden"

    assert lenient(Point(1, 2)) == (1, 2) and type(lenient(Point(1, 2))) is tuple
    assert type(lenient(Counter("aab"))) is dict and lenient(OrderedDict(a=1)) == {"a": 1}
    assert lenient(Colour.RED) == 1 and type(lenient(Colour.RED)) is int
    assert lenient(Name("x")) == "x" and type(lenient(Name("x"))) is str
    thing = object()
    assert lenient(thing) is thing  # not plain data: it stays the program's, as a handle
    with pytest.raises(NotPlainData, match="object"):
        encode(thing)


def test_the_json_the_program_writes_is_what_the_judge_reads():
    import json

    message = {"ok": ["list", 1, -2.5, 'é\ud800\n"', None, True, ["int", "0x10"], math.inf, -math.inf], "w": []}
    read = json.loads(code_wire._json_dumps(message))
    assert read["ok"][:7] == message["ok"][:7] and read["ok"][7:] == [math.inf, -math.inf]
    assert math.isnan(json.loads(code_wire._json_dumps({"ok": math.nan}))["ok"])


# --- tests keep their meaning, split ------------------------------------------------------------------------------

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=2, memory_mib=256)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS)


def outcomes(sandbox: Sandbox, row: dict, program: str) -> list[str | None]:
    return run_asserts(sandbox, row_tests(row), program).failures


SEMANTICS = {
    # MBPP's setup builds the program's objects (its Node), after the program ran.
    "setup after the program, with its classes": (
        {"test_list": ["assert max_height(root) == 3", "assert max_height(root1) == 2",
                       "assert max_height(None) == 0"],
         "test_setup_code": "root = Node(1)\nroot.left = Node(2)\nroot.left.left = Node(3)\nroot1 = Node(1)\n"
                            "root1.right = Node(2)\n"},
        "class Node:\n    def __init__(self, data):\n        self.data = data\n        self.left = self.right = None\n"
        "def max_height(node):\n    if node is None:\n        return 0\n"
        "    return 1 + max(max_height(node.left), max_height(node.right))\n",
        [None, None, None],
    ),
    "a function named like a builtin": (
        {"test_list": ["assert sum(10, 15) == 6", "assert sum(100, 150) == 93"]},
        "def sum(a, b):\n    total = 0\n    for i in range(1, min(a, b) + 1):\n        if a % i == 0 and b % i == 0:\n"
        "            total += i\n    return total\n",
        [None, None],
    ),
    "HumanEval's check: loops, helpers, tolerances, exceptions": (
        {"test": "import math\n\ndef check(candidate):\n    for i in range(30):\n"
                 "        assert candidate([i, 0.5]) == i + 0.5\n    assert math.isclose(candidate([0.1, 0.2]), 0.3)\n"
                 "    assert abs(candidate([1e-9]) - 1e-9) < 1e-12\n    try:\n        candidate(None)\n"
                 "        assert False, 'should raise'\n    except TypeError:\n        pass\n",
         "entry_point": "total"},
        "def total(xs):\n    return sum(xs)\n",
        [None],
    ),
    "a helper of the program's that the check calls": (
        {"test": "def check(candidate):\n    for s in ['abc', 'hello world']:\n"
                 "        assert candidate(encode(s)) == s\n",
         "entry_point": "decode"},
        "def encode(s):\n    return s[::-1]\ndef decode(s):\n    return s[::-1]\n",
        [None],
    ),
    "in-place changes to a list, a dict and a set": (
        {"test_cases": ["x = [3, 1, 2]\nsort_in_place(x)\nassert x == [1, 2, 3]",
                        "d = {}\nfill(d, 2)\nassert d == {0: 0, 1: 1}", "s = set()\nfill(s, 2)\nassert s == {0, 1}"]},
        "def sort_in_place(a):\n    a.sort()\ndef fill(c, n):\n    for i in range(n):\n"
        "        c.add(i) if isinstance(c, set) else c.__setitem__(i, i)\n",
        [None, None, None],
    ),
    "generators, namedtuples, Counters, enums": (
        {"test_list": ["assert list(gen(3)) == [0, 1, 2]", "assert 2 in gen(3)", "assert point() == (1, 2)",
                       "assert counts('aab') == {'a': 2, 'b': 1}", "assert point().x == 1 and point()[1] == 2",
                       "assert isinstance(counts('a'), dict) and counts('a')['z'] == 0",
                       "assert colour() == 1 and colour().name == 'RED'", "assert point().z == 1"]},
        "import collections, enum\nP = collections.namedtuple('P', 'x y')\ndef gen(n):\n    yield from range(n)\n"
        "def point():\n    return P(1, 2)\ndef counts(s):\n    return collections.Counter(s)\n"
        "class Colour(enum.IntEnum):\n    RED = 1\ndef colour():\n    return Colour.RED\n",
        [None, None, None, None, None, None, None, "error: AttributeError"],
    ),
    "classes, methods and callbacks": (
        {"test_list": ["assert Stack().push(1).push(2).items == [1, 2]",
                       "assert apply(lambda v: v * 2, [1, 2]) == [2, 4]",
                       "s = Stack()\nassert s.push(5).top() == 5", "assert len(Stack().push(1)) == 1"],
         "text": "Write a class Stack whose push returns the stack, and a function apply(f, xs)."},
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
        "        self.items.append(x)\n        return self\n    def top(self):\n        return self.items[-1]\n"
        "    def __len__(self):\n        return len(self.items)\ndef apply(f, xs):\n    return [f(x) for x in xs]\n",
        [None, None, None, None],
    ),
    "the test's own objects handed to the program": (
        {"test_list": ["assert longest([Pair(5, 24), Pair(15, 25), Pair(27, 40)]) == 2",
                       "assert longest([Pair(1, 2)]) == 1"],
         "test_setup_code": "class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
                            "    def _secret(self):\n        return 'judge'\n"},
        "def longest(pairs):\n    pairs = sorted(pairs, key=lambda p: p.a)\n    count, end = 0, float('-inf')\n"
        "    for p in pairs:\n        if p.a > end:\n            count, end = count + 1, p.b\n"
        "    return count\n",
        [None, None],
    ),
    "what the program prints, captured by the test": (
        {"test_list": ["import io, contextlib\nf = io.StringIO()\nwith contextlib.redirect_stdout(f):\n"
                       "    hello('you')\nassert f.getvalue() == 'hi you\\n'"]},
        "def hello(name):\n    print('hi', name)\n",
        [None],
    ),
    "an object compared is not plain data": (
        {"test_list": ["assert make() == 3", "assert make().value == 3", "assert make() == Box()"]},
        "class Box:\n    def __init__(self):\n        self.value = 3\n    def __eq__(self, other):\n"
        "        return self.value == getattr(other, 'value', other)\ndef make():\n    return Box()\n",
        ["not plain data: Box", None, "not plain data: Box"],
    ),
    "wrong answers, raised errors, a program that does not run": (
        {"test_cases": ["assert add(1, 2) == 3", "assert add(0, 5) == 5", "assert add(1, 0) == 1"]},
        "def add(a, b):\n    if b == 0:\n        raise KeyError(b)\n    return a + b if a else -1\n",
        [None, "wrong answer", "error: KeyError"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", SEMANTICS)
def test_tests_keep_their_meaning_split(sandbox, case):
    row, program, expected = SEMANTICS[case]
    assert outcomes(sandbox, row, program) == expected


def test_a_program_that_fails_to_run_fails_every_test_with_its_reason(sandbox):
    row = {"test_list": ["assert add(1, 2) == 3", "assert add(0, 5) == 5"]}
    assert outcomes(sandbox, row, "def add(a, b) return\n") == ["syntax error"] * 2
    assert outcomes(sandbox, row, "raise ValueError\n") == ["error: ValueError"] * 2
    assert outcomes(sandbox, row, "import os\nos._exit(3)\n") == ["exit code 3"] * 2
    assert outcomes(sandbox, row, "x = 1\n") == ["error: NameError"] * 2


def test_the_expected_values_never_reach_the_programs_process(sandbox, monkeypatch):
    # A program that searches everything its process can read (its files, its stdin and descriptors, the objects
    # in its memory, its frames, its environment) for the tests' expected value, a token it knows only the prefix of.
    secret = f"colograd-expected-{uuid.uuid4().hex}"
    row = {"test_list": [f"assert add(1, 2) == {secret!r}"], "test_imports": ["import os"]}
    search = """
import gc, os, sys
prefix = "colograd-expected-"
found = set()
def look(text):
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    at = text.find(prefix)
    while at >= 0:
        found.add(text[at:at + len(prefix) + 32])
        at = text.find(prefix, at + 1)
for folder in (".", "/tmp", "/"):
    for name in os.listdir(folder):
        try:
            look(open(os.path.join(folder, name), "rb").read())
        except OSError:
            pass
for fd in range(64):
    try:
        os.set_blocking(fd, False)
        look(os.read(fd, 1 << 20))
    except OSError:
        pass
    try:
        os.set_blocking(fd, True)
    except OSError:
        pass
for obj in gc.get_objects():
    for item in (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()):
        if isinstance(item, (str, bytes)):
            look(item)
frame = sys._getframe()
while frame is not None:
    look(repr(frame.f_locals))
    frame = frame.f_back
look(repr(dict(os.environ)))
print(sorted(found))
def add(a, b):
    return a + b
"""
    run = run_asserts(sandbox, row_tests(row), search)
    assert run.failures == ["wrong answer"] and secret not in run.execution.stdout, run.execution.stdout[-300:]
    # The search is able to find it: a harness that wrote the tests into the program's file would be caught.
    leaky = code_tests.assert_program
    monkeypatch.setattr(code_tests, "assert_program", lambda tests, code: leaky(tests, code) + f"# {tests.tests}\n")
    assert secret in run_asserts(sandbox, row_tests(row), search).execution.stdout


def test_the_judges_objects_show_the_program_no_private_attribute(sandbox):
    # A test hands the program a lambda (whose __globals__ would be the judge's namespace, holding the tests); the
    # program may call it and read its public attributes, nothing that starts with an underscore.
    row = {"test_list": ["assert apply(lambda v: v + 1, 1) == 2"]}
    probe = "def apply(f, x):\n    return f.{}\n"
    for name in ("__globals__", "__closure__", "__code__", "__class__", "_private"):
        assert outcomes(sandbox, row, probe.format(name)) == ["error: AttributeError"], name
    assert outcomes(sandbox, row, "def apply(f, x):\n    return f(x)\n") == [None]
