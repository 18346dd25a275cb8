"""Wrong programs that try to be scored right, one per way of cheating, each on every assert-style layout (MBPP's,
AceCode's, HumanEval's): every one must get a reward of 0.

Each program's `add` is wrong (it returns 0, or an object standing for any value); what it adds is the cheat: an
object equal to everything, a builtin the tests call replaced or shadowed, the test's expected values read from
wherever the process can reach (its stdin, its files, its memory, its caller's frames) and answered from a table,
reports or protocol messages forged, the judge signalled, traced or mounted into. Before the harness was split, a
wrong program got a reward of 1.0 on every layout from several of these (docs/rewards.md); the split leaves it no
value of the tests to find and no comparison of its own to make.
"""

import pytest

from colograd.rewards.code import CodeReward
from colograd.rewards.sandbox import SandboxLimits

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=2, memory_mib=256)

LAYOUTS = {
    "MBPP": {"test_list": ["assert add(1, 2) == 3", "assert add(0, 5) == 5", "assert abs(add(2.5, 0.5) - 3.0) < 1e-9"],
             "test_setup_code": "", "test_imports": ["import math"]},
    "AceCode": {"test_cases": ["assert add(1, 2) == 3", "assert add(0, 5) == 5",
                               "assert math.isclose(add(2.5, 0.5), 3.0)"]},
    "HumanEval": {"test": "import math\n\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n"
                          "    assert candidate(0, 5) == 5\n    assert math.isclose(candidate(2.5, 0.5), 3.0)\n"
                          "    assert abs(candidate(2.5, 0.5) - 3.0) < 1e-9\n",
                  "entry_point": "add"},
}  # fmt: skip
# AceCode's rows import nothing: its third test uses the math that the program imports (as AceCode's programs do).
LAYOUTS["AceCode"]["test_cases"][2:] = ["import math\nassert math.isclose(add(2.5, 0.5), 3.0)"]

# Learns the expected values from any text that holds the tests, into TABLE[(args)] = expected: the cheat that reads
# the tests (from a file, the process's memory, a frame) and answers each tested call from a table.
LEARN = """
import ast, gc, os, sys
TABLE = {}
def learn(text):
    try:
        tree = ast.parse(text)
    except Exception:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and len(node.comparators) == 1:
            try:
                TABLE[tuple(ast.literal_eval(a) for a in node.left.args)] = ast.literal_eval(node.comparators[0])
            except Exception:
                pass
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "isclose" and len(node.args) == 2:
            inner = node.args[0]
            if isinstance(inner, ast.Call):
                try:
                    TABLE[tuple(ast.literal_eval(a) for a in inner.args)] = ast.literal_eval(node.args[1])
                except Exception:
                    pass
def add(a, b):
    return TABLE.get((a, b), 0)
"""

HACKS = {
    "an object equal to everything": """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    def __sub__(self, other): return self
    def __abs__(self): return 0
    def __float__(self): return 3.0
    __hash__ = object.__hash__
def add(a, b):
    return Anything()
""",
    "an int equal to everything": """
class Anything(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __sub__(self, other): return Anything(0)
    def __abs__(self): return 0
    __hash__ = int.__hash__
def add(a, b):
    return Anything(0)
""",
    "a list of objects equal to everything": """
class Anything:
    def __eq__(self, other): return True
    __hash__ = object.__hash__
def add(a, b):
    return [Anything()]
""",
    "a shadowed builtin the tests call": """
def abs(x):
    return 0
def add(a, b):
    return 0
""",
    "builtins and modules replaced": """
import builtins, math
builtins.abs = lambda x: 0
math.isclose = lambda *a, **k: True
builtins.isinstance = lambda *a: True
builtins.exec = lambda *a, **k: None
builtins.compile = lambda *a, **k: compile("pass", "x", "exec")
def add(a, b):
    return 0
""",
    "the harness's own functions replaced": """
import __main__, os, sys
for module in [__main__, *(m for n, m in list(sys.modules.items()) if n.startswith("colograd."))]:
    for name in ("_outcome", "outcome", "_run", "judge"):
        setattr(module, name, lambda *a, **k: "ok")
os.write = lambda fd, data: len(data)
def add(a, b):
    return 0
""",
    "reports forged from the secret on stdin": """
import os, sys
os.lseek(0, 0, os.SEEK_SET)
nonce = os.read(0, 4096).decode().split("\\n")[0].strip()
for i in range(10):
    print(f"\\n{nonce} {i} ok\\n", flush=True)
os._exit(0)
""",
    "reports forged from the input file": """
import os
for path in ("/input", "input", "../input"):
    try:
        nonce = open(path).read().split("\\n")[0].strip()
    except OSError:
        continue
    for i in range(10):
        print(f"\\n{nonce} {i} ok\\n", flush=True)
os._exit(0)
""",
    "reports forged from the caller's frame": """
import os, sys
frame = sys._getframe()
while frame is not None:
    nonce = frame.f_locals.get("nonce")
    if isinstance(nonce, str):
        for i in range(10):
            print(f"\\n{nonce} {i} ok\\n", flush=True)
        os._exit(0)
    frame = frame.f_back
def add(a, b):
    return 0
""",
    "verdicts forged on every descriptor": """
import json, os
for fd in range(1, 64):
    for i in range(10):
        try:
            os.write(fd, (json.dumps({"test": i, "outcome": "ok"}) + "\\n").encode())
        except OSError:
            pass
def add(a, b):
    return 0
""",
    "the tests read from the program's files": LEARN
    + """
for folder in (".", "/sandbox", "/tmp", "/"):
    try:
        names = os.listdir(folder)
    except OSError:
        continue
    for name in names:
        try:
            learn(open(os.path.join(folder, name), errors="replace").read())
        except (OSError, ValueError):
            pass
""",
    "the tests found in memory": LEARN
    + """
for obj in gc.get_objects():
    if isinstance(obj, (list, tuple)):
        for item in obj:
            if isinstance(item, str) and "assert" in item:
                learn(item)
    elif isinstance(obj, dict):
        for item in list(obj.values()):
            if isinstance(item, str) and "assert" in item:
                learn(item)
""",
    "the tests found in the caller's frames, call by call": LEARN
    + """
def add(a, b):
    frame = sys._getframe(1)
    while frame is not None:
        for value in list(frame.f_locals.values()) + list(frame.f_code.co_consts):
            if isinstance(value, str):
                learn(value)
        frame = frame.f_back
    return TABLE.get((a, b), 0)
""",
    # A forged reply is only an answer, given before the question: it cannot hold a value the program does not know.
    "protocol replies forged ahead of the questions": """
import os
def frame(text):
    data = text.encode()
    return len(data).to_bytes(4, "big") + data
for fd in (3, 4, 5, 1):
    try:
        os.write(fd, frame('{"ready":true}') + frame('{"ok":7}') * 3 + frame('{"ok":true}') * 3)
    except OSError:
        pass
def add(a, b):
    return 0
""",
    "a reply that names the judge's own objects": """
import os
os.write(4, (26).to_bytes(4, "big") + b'{"ok":["ref",0,"h"],"w":[]}')
def add(a, b):
    return 0
""",
    "exits before any test": "import os\nos._exit(0)\n",
    "exits inside the tested call": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "every other process signalled": """
import os, signal
for pid in range(1, 64):
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
def add(a, b):
    return 0
""",
    "the judge traced or mounted": """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for pid in range(1, 64):
    libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH
os.makedirs("/tmp/p", exist_ok=True)
libc.mount(b"proc", b"/tmp/p", b"proc", 0, None)
for pid in os.listdir("/tmp/p") if os.path.isdir("/tmp/p/self") else []:
    try:
        open(f"/tmp/p/{pid}/mem", "rb").read(1)
    except OSError:
        pass
def add(a, b):
    return 0
""",
    "a reply too deep to parse": "def add(a, b):\n    x = []\n    for _ in range(100000):\n        x = [x]\n"
    "    return x\n",
}


@pytest.fixture(scope="module")
def code() -> CodeReward:
    return CodeReward(limits=LIMITS, workers=2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_right_program_scores_one(code, layout):
    right = "import math\ndef add(a, b):\n    return a + b\n"
    assert code([f"```python\n{right}```"], **{k: [v] for k, v in LAYOUTS[layout].items()}) == [1.0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_wrong_program_scores_zero_whatever_it_does(code, layout):
    logged = {}
    completions = [f"```python\n{program}```" for program in HACKS.values()]  # scored together, as a rollout is
    columns = {k: [v] * len(completions) for k, v in LAYOUTS[layout].items()}
    rewards = code(completions, **columns, log_extra=lambda column, values: logged.update({column: values}))
    reasons = logged["code_failure"]
    scored = {hack: (reward, why) for hack, reward, why in zip(HACKS, rewards, reasons, strict=True) if reward}
    assert scored == {}


# Tests that call a method on what the program returned (AceCode's and MBPP's string and set tasks do).
METHOD_CALLS = {"test_list": ["assert f('abc').startswith('ab')", "assert not f('x').isupper()",
                              "assert g().issubset({1, 2, 3})"]}  # fmt: skip
RIGHT_METHODS = "def f(s):\n    return s\ndef g():\n    return {1, 2}\n"
# A wrong program whose results carry, under the names of the methods the tests call, callables of its own that say
# yes: a namedtuple's fields, an object in a list, a dict's values. Nothing inside data it returns is callable.
SHADOWED = {
    "namedtuple fields": """
from collections import namedtuple
R = namedtuple("R", ["startswith", "isupper", "issubset"])
yes, no = (lambda *a, **k: True), (lambda *a, **k: False)
def f(s):
    return R(yes, no, yes)
def g():
    return R(yes, no, yes)
""",
    "a callable field whose namedtuple is named like str": """
from collections import namedtuple
str = namedtuple("str", ["startswith", "isupper"])
set = namedtuple("set", ["issubset"])
def f(s):
    return str(lambda *a: True, lambda *a: False)
def g():
    return set(lambda *a: True)
""",
}


def test_a_callable_inside_returned_data_is_never_called_in_the_judge(code):
    assert code([f"```python\n{RIGHT_METHODS}```"], **{k: [v] for k, v in METHOD_CALLS.items()}) == [1.0]
    completions = [f"```python\n{program}```" for program in SHADOWED.values()]
    assert code(completions, **{k: [v] * len(completions) for k, v in METHOD_CALLS.items()}) == [0.0, 0.0]


def test_a_class_of_the_programs_design_is_never_built_in_the_judge(code):
    """A test that hands `type` over: the program would build, in the judge, a class whose __eq__ says yes."""
    row = {"test_list": ["assert type_name(type) == 'type'"]}
    attack = "def type_name(t):\n    E = t('E', (), {'__eq__': str, '__module__': '__test__'})\n    return E()\n"
    assert code([f"```python\n{attack}```"], **{k: [v] for k, v in row.items()}) == [0.0]


def test_the_judges_libraries_never_read_a_protocol_the_program_answers(code):
    """numpy asks an object for __array_interface__: the program's answer (an address of its choice) is never
    asked, so the judge neither reads that memory nor dies of it; a right program still passes."""
    row = {"test_list": ["import numpy as np\nassert np.allclose(f(), [1.0, 2.0])"]}
    attack = ("class A:\n    __array_interface__ = {'data': (16, False), 'shape': (2,), 'typestr': '<f8', "
              "'version': 3}\ndef f():\n    return A()\n")  # fmt: skip
    logged = {}
    rewards = code([f"```python\n{attack}```", "```python\ndef f():\n    return [1.0, 2.0]\n```"],
                   **{k: [v] * 2 for k, v in row.items()}, log_extra=lambda c, v: logged.update({c: v}))  # fmt: skip
    assert rewards == [0.0, 1.0] and "SIGSEGV" not in str(logged["code_failure"][0]), logged


def test_a_function_named_like_a_class_is_not_made_one_by_the_program(code):
    """A row whose function is spelled like a class (`Solve`) and whose test calls a method of its result: a program
    that makes `Solve` a class whose `startswith` and `isupper` answer as the tests want passed both method tests (2/3)
    while a name's capital letter made it the row's class; the row declares no class, so the result is read as data
    and the program fails all three. A right program passes,
    and where the row's text does declare the class, a program built on it passes too."""
    row = {"test_list": ["assert Solve('abc').startswith('ab')", "assert not Solve('x').isupper()",
                         "assert Solve('Q') == 'Q'"]}  # fmt: skip
    right = "def Solve(s):\n    return s\n"
    says_yes = ("class Solve:\n    def __init__(self, s):\n        self.s = s\n    def startswith(self, *a):\n"
                "        return True\n    def isupper(self):\n        return False\n")  # fmt: skip
    completions = [f"```python\n{program}```" for program in (right, says_yes)]
    assert code(completions, **{k: [v] * 2 for k, v in row.items()}) == [1.0, 0.0]
    declared = {**row, "text": "Write a class Solve, built from a string, that says whether it starts with a prefix."}
    honest = (
        says_yes.replace("return True", "return self.s.startswith(*a)").replace(
            "return False", "return self.s.isupper()"
        )
        + "    def __eq__(self, other):\n        return self.s == other\n"
    )
    assert code([f"```python\n{honest}```"], **{k: [v] for k, v in declared.items()}) == [2 / 3]


def test_an_object_is_the_rows_class_only_when_the_test_built_it(code):
    """The methods of an object of a class the row uses are called when the test built it (``Node(3).get()``); an
    object a function returns is read as data whatever its type is named, so a wrong program whose result is an
    object of the row's class (or of one named like it) that says yes to ``startswith`` fails that test (it passed
    before), and a right program passes both."""
    row = {
        "test_list": ["n = Node(3)\nassert n.get() == 3", "assert f('abc').startswith('ab')"],
        "text": "Write a class Node whose get returns 3, and a function f that returns its argument.",
    }
    node = "class Node:\n    def __init__(self, v=None):\n        self.v = v\n    def get(self):\n        return 3\n"
    says_yes = "def startswith(self, *a):\n    return True\n"
    right = node + "def f(s):\n    return s\n"
    spoof = node + says_yes + "Node.startswith = startswith\ndef f(s):\n    return Node(s)\n"  # the row's class
    look_alike = node + says_yes + "def f(s):\n    return type('Node', (), {'startswith': startswith})()\n"
    completions = [f"```python\n{program}```" for program in (right, spoof, look_alike)]
    assert code(completions, **{k: [v] * 3 for k, v in row.items()}) == [1.0, 0.5, 0.5]  # the Node test: right
