"""The split harness over generated values of every type its schema carries (issue 49): a right program passes each
generated test and an always-wrong one fails each, as an unsandboxed run of the same tests and program says.

Each example is a row of MBPP's layout whose tests pass values to the program and compare what comes back, in both
directions: ``same(f(V), V)`` (the test's value to the program and back) and ``same(g0(), V)`` (a value the program
makes), where V is source text for a value built of None, bools, ints of any size, floats (inf, nan, -0.0), complex
numbers, str, bytes, lists, tuples, dicts, sets, frozensets, dates, times, datetimes, timedeltas, Fractions,
Decimals, numpy arrays (any shape, dtype and byte order, their bytes as they come) and scalars, namedtuples, enums of
each kind, Counters, OrderedDicts and defaultdicts, and the builtin data types themselves (``int``, ``str``, ...).
``same`` is the row's own: equal, of the same type by name (a value is rebuilt as a type of the receiver's), to the
last bit (its repr: -0.0, nan, Decimal("1.10")).

Hypothesis draws the examples derandomized, so every run sees the same ones; each starts two sandboxed executions.
"""

import collections
import datetime
import decimal
import enum
import fractions

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from colograd.rewards.code_tests import row_tests, run_asserts
from colograd.rewards.sandbox import Sandbox, SandboxLimits

pytestmark = pytest.mark.slow

SETTINGS = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    # No shrinking: each example costs two executions, and shrinking one that fails took over 5 minutes; a failing
    # example is shown as drawn.
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The row's imports and setup: the judge's own enum and namedtuple (their values cross to the program and back),
# and the comparison.
SETUP = """
import collections, datetime, decimal, enum, fractions
import numpy as np

class Shade(enum.Enum):
    DARK = 1
    LIGHT = "light"

Q = collections.namedtuple("Q", "a b")

def same(got, want):
    if type(got).__name__ != type(want).__name__:
        return False
    if isinstance(want, np.ndarray):
        return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))
    if isinstance(want, dict):
        factories = repr(getattr(got, "default_factory", None)) == repr(getattr(want, "default_factory", None))
        return factories and list(got) == list(want) and all(same(got[k], want[k]) for k in want)
    if isinstance(want, (set, frozenset, int)):  # an int: repr refuses past 4300 digits
        return got == want
    return repr(got) == repr(want) and (got == want or want != want)
"""
# The program's own types: the tests name them, so they are the program's (a call of P, a read of Colour.RED).
PROGRAM_TYPES = """
import collections, datetime, decimal, enum, fractions
import numpy as np

P = collections.namedtuple("P", "x y")

class Colour(enum.Enum):
    RED = 1
    GREEN = "g"
    BLUE = (1, 2)

class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2

class Name(enum.StrEnum):
    A = "a"
    B = "b"

class Perm(enum.Flag):
    R = 4
    W = 2

class Bits(enum.IntFlag):
    ONE = 1
    TWO = 2
"""
DTYPES = ["|b1", "|i1", "|u1", "<i2", ">i2", "<u4", "<i8", ">i8", "<f2", "<f4", ">f4", "<f8", ">f8", "<c8", "<c16"]

# A generated value: its source text and whether it names the judge's own types (then only the test can make it).
Value = tuple[str, bool]


def _float(x: float) -> str:
    return repr(x) if x == x and abs(x) != float("inf") else f"float({str(x)!r})"


def _int(n: int) -> str:
    return repr(n) if abs(n) < 10**100 else hex(n)  # hex: str(int) refuses past 4300 digits


def _numpy(dtype: str, shape: list[int], data: bytes, scalar: bool) -> str:
    made = f"np.frombuffer(bytes.fromhex({data.hex()!r}), dtype={dtype!r})"
    return f"{made}[0]" if scalar else f"{made}.reshape({shape}).copy()"


def _numpy_values(scalar: bool) -> st.SearchStrategy[Value]:
    def build(draw_dtype_shape):
        dtype, shape = draw_dtype_shape
        size = np.dtype(dtype).itemsize * (1 if scalar else int(np.prod(shape, dtype=np.int64)))
        return st.binary(min_size=size, max_size=size).map(lambda data: (_numpy(dtype, shape, data, scalar), False))

    shapes = st.just([]) if scalar else st.lists(st.integers(0, 3), max_size=3)
    return st.tuples(st.sampled_from(DTYPES), shapes).flatmap(build)


def _plain(text: str) -> Value:
    return text, False


# One strategy per kind of scalar value; every example holds one of each, and nested values of any.
HASHABLE_KINDS = (
    st.none().map(lambda _: _plain("None")),
    st.booleans().map(lambda b: _plain(repr(b))),
    st.one_of(st.integers(), st.integers(-(1 << 100), 1 << 100), st.integers(-9, 9).map(lambda k: k << 20_000)).map(
        lambda n: _plain(_int(n))
    ),
    st.floats(allow_nan=False).map(lambda x: _plain(_float(x))),
    st.tuples(st.floats(allow_nan=False), st.floats(allow_nan=False)).map(
        lambda c: _plain(f"complex({_float(c[0])}, {_float(c[1])})")
    ),
    st.text(max_size=12).map(lambda s: _plain(repr(s))),
    st.binary(max_size=12).map(lambda b: _plain(repr(b))),
    st.dates().map(lambda d: _plain(repr(d))),
    st.times().map(lambda t: _plain(repr(t.replace(fold=0)))),
    st.datetimes(timezones=st.none() | st.just(datetime.UTC)).map(lambda d: _plain(repr(d.replace(fold=0)))),
    st.timedeltas().map(lambda d: _plain(repr(d))),
    st.fractions().map(lambda f: _plain(f"fractions.Fraction({f.numerator}, {f.denominator})")),
    st.one_of(st.decimals(allow_nan=False), st.decimals(allow_nan=False, places=3)).map(  # places: Decimal("1.100")
        lambda d: _plain(f"decimal.Decimal({str(d)!r})")
    ),
    *(
        st.sampled_from(members).map(_plain)
        for members in (
            ["Colour.RED", "Colour.GREEN", "Colour.BLUE"],
            ["Level.LOW", "Level.HIGH"],
            ["Name.A", "Name.B"],
            ["Perm.R", "Perm.W"],
            ["Bits.ONE", "Bits.TWO"],
        )  # fmt: skip
    ),
    st.sampled_from(["Shade.DARK", "Shade.LIGHT"]).map(lambda text: (text, True)),
    # The builtin data types themselves (a test's ``remove_type(xs, int)``): they cross by name.
    st.sampled_from(
        ["bool", "int", "float", "complex", "str", "bytes", "list", "tuple", "dict", "set", "frozenset"]
    ).map(_plain),
)
KINDS = (*HASHABLE_KINDS, st.just(_plain("float('nan')")), _numpy_values(scalar=True), _numpy_values(scalar=False))
HASHABLE_LEAVES = st.one_of(*HASHABLE_KINDS)


def _joined(template: str, items: list[Value]) -> Value:
    return template.format(", ".join(text for text, _ in items)), any(judge for _, judge in items)


def _pairs(keys: list[Value], values: list[Value]) -> Value:
    pairs = [(f"{k}: {v}", kj or vj) for (k, kj), (v, vj) in zip(keys, values, strict=False)]
    return _joined("{{{}}}", pairs)


def _containers(children: st.SearchStrategy[Value]) -> st.SearchStrategy[Value]:
    hashables = st.lists(HASHABLE_LEAVES, max_size=3)
    small = st.lists(children, max_size=3)
    counts = st.lists(st.tuples(HASHABLE_LEAVES, st.integers(-3, 3)), max_size=3)
    return st.one_of(
        small.map(lambda items: _joined("[{}]", items)),
        small.map(lambda items: _joined("({},)", items) if items else _plain("()")),
        st.tuples(hashables, small).map(lambda keys_values: _pairs(*keys_values)),
        hashables.map(lambda items: _joined("{{{}}}", items) if items else _plain("set()")),
        hashables.map(lambda items: _joined("frozenset([{}])", items)),
        st.tuples(children, children).map(lambda xy: _joined("P({})", list(xy))),
        st.tuples(children, children).map(lambda ab: (_joined("Q({})", list(ab))[0], True)),
        counts.map(lambda kc: _joined("collections.Counter({{{}}})", [(f"{k}: {c}", j) for (k, j), c in kc])),
        st.tuples(hashables, small).map(_ordered_dict),
        st.tuples(hashables, small).map(_default_dict),
    )


def _ordered_dict(keys_values: tuple[list[Value], list[Value]]) -> Value:
    keys, values = keys_values
    pairs = [_joined("({})", [k, v]) for k, v in zip(keys, values, strict=False)]
    return _joined("collections.OrderedDict([{}])", pairs)


def _default_dict(keys_values: tuple[list[Value], list[Value]]) -> Value:
    keys, values = keys_values
    return _joined("collections.defaultdict(list, {})", [_pairs(keys, [_joined("[{}]", [v]) for v in values])])


VALUES = st.recursive(st.one_of(*KINDS), _containers, max_leaves=6)
EXAMPLES = st.tuples(st.tuples(*KINDS), st.lists(VALUES, min_size=1, max_size=4)).map(lambda ab: [*ab[0], *ab[1]])


def row_and_programs(values: list[Value]) -> tuple[dict, str, str]:
    """The row (each value there and back, and each the program can make made by it) and a right and an always-wrong
    program for it."""
    tests, right, wrong = [], [PROGRAM_TYPES, "def f(x):\n    return x\n"], [PROGRAM_TYPES]
    wrong.append("def f(x):\n    return ('wrong', x)\n")  # no finite value is its own ('wrong', value)
    for i, (text, judge_only) in enumerate(values):
        tests.append(f"assert same(f({text}), {text})")
        if not judge_only:
            tests.append(f"assert same(g{i}(), {text})")
            right.append(f"def g{i}():\n    return {text}\n")
            wrong.append(f"def g{i}():\n    return ('wrong', {text})\n")
    return {"test_list": tests, "test_setup_code": SETUP}, "\n".join(right), "\n".join(wrong)


def unsandboxed(row: dict, program: str) -> list[str | None]:
    """Each test's outcome when the program, the setup and the test run in one interpreter (no harness)."""
    names: dict = {"__name__": "solution"}
    exec(program, names)
    exec(row["test_setup_code"], names)
    outcomes = []
    for test in row["test_list"]:
        try:
            exec(test, names)
            outcomes.append(None)
        except AssertionError:
            outcomes.append("wrong answer")
    return outcomes


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxLimits(wall_s=20.0, cpu_s=5, memory_mib=512))


@SETTINGS
@given(values=EXAMPLES)
def test_a_right_program_passes_and_a_wrong_one_fails_on_values_of_every_type(sandbox, values):
    row, right, wrong = row_and_programs(values)
    tests = row_tests(row)
    assert unsandboxed(row, right) == [None] * len(tests.tests)  # what the harness must agree with
    assert unsandboxed(row, wrong) == ["wrong answer"] * len(tests.tests)
    assert run_asserts(sandbox, tests, right).failures == [None] * len(tests.tests), row["test_list"]
    assert run_asserts(sandbox, tests, wrong).failures == ["wrong answer"] * len(tests.tests), row["test_list"]


def test_the_generated_values_cover_every_type_the_schema_carries():
    # Every kind of value the strategy makes, as the judge would build it: none of the schema's types is left out.
    names = {"np": np, "collections": collections, "datetime": datetime, "decimal": decimal, "enum": enum,
             "fractions": fractions}  # fmt: skip
    exec(PROGRAM_TYPES + SETUP, names)
    seen: set[str] = set()

    @settings(max_examples=50, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(values=EXAMPLES)
    def collect(values):
        def walk(v):
            seen.add(type(v).__name__)
            if isinstance(v, dict):
                for item in [*v.keys(), *v.values()]:
                    walk(item)
            elif isinstance(v, (list, tuple, set, frozenset)):
                for item in v:
                    walk(item)

        for text, _ in values:
            walk(eval(text, names))

    collect()
    wanted = {"NoneType", "bool", "int", "float", "complex", "str", "bytes", "list", "tuple", "dict", "set",
              "frozenset", "date", "time", "datetime", "timedelta", "Fraction", "Decimal", "ndarray", "P", "Q",
              "Colour", "Level", "Name", "Perm", "Bits", "Shade", "Counter", "OrderedDict", "defaultdict"}  # fmt: skip
    assert wanted <= seen, wanted - seen
    assert any(name.startswith(("float", "int", "uint", "complex", "bool")) and name not in ("float", "int", "bool",
               "complex") for name in seen)  # fmt: skip
