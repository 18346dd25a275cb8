"""The split harness for assert-style tests: the program's process computes values; a judge that never runs model
code decides each test. Standard library only: this file's source runs inside the sandbox, in both processes.

    trainer ──orders──▶ launcher ─┬─ program   the interpreter runs `serve`: the row's imports, then the completion's
                                  │            program, then answers requests about the program's objects
                                  └─ judge     `judge`: the row's imports and setup, then each test, in a namespace
                                               of the judge's own: builtins, the standard library and numpy, the
                                               row's imports and setup, and for the names the row makes the
                                               program's (its entry point, the functions and classes the tests call),
                                               handles on the program's objects

Nothing live crosses. What goes either way is data (`encode`): None, bool, int, float, complex, str, bytes, lists,
tuples, dicts, sets and frozensets, dates and times, Fraction, Decimal, numpy arrays and scalars, namedtuples,
enums, Counters, OrderedDicts and defaultdicts, each rebuilt on arrival as a fresh value of the receiver's own types:
the methods, comparisons and formatting a test runs on what the program returned are the judge's. A generator or
iterator is materialised (bounded) before it crosses. What is not data stays where it is, behind a handle: a callable
a test passes is called by the judge when the program asks (with data, for data); the program's objects answer
requests from the judge, but the judge calls a method of one only when the row names its class, so a returned proxy
cannot answer `.startswith(expected)` for the test. An exception comes back as its builtin type's name; one with a
control-flow meaning (StopIteration, GeneratorExit, SystemExit, ...) fails the test instead of ending a loop. The
tests' expected values never leave the judge, and the program gets nothing of the tests but the data they pass it.

Requests go both ways over a pair of pipes, one message at a time (`Channel`), each bounded in size and parsed as
untrusted by the judge: anything that is not what `encode` makes ends the execution for the program (`ProgramGone`).

A test keeps its meaning: its setup runs after the program, where the program's classes exist (MBPP's setup builds
trees of the program's ``Node``); HumanEval's ``check(candidate)`` gets the program's function; a list or dict an
argument holds comes back as the program left it (in-place sorting); what the program prints during a call reaches
the judge's ``sys.stdout`` (so a test that captures it sees it); an exception the program raises is raised in the test
as the same builtin type (``try: f(-1) except ValueError: pass``). What does not: a test that patches the program's
builtins or modules (``mock.patch``), checks identity between what it passed and what came back, or reads the
program's source (docs/rewards.md).
"""

import builtins
import marshal
import os
import sys

MAX_MESSAGE = 64 << 20  # bytes of one message; a larger value fails the program
MAX_ITEMS = 100_000  # items of a generator or iterator materialised before it crosses
_DEPTH = 200  # nesting of data
_SAFE_INT = 1 << 53  # ints beyond this travel as hex: str(int) refuses past 4300 digits, hex does not
# Exceptions whose meaning is control flow: raised by the program, they fail the test rather than end its loop.
CONTROL_FLOW = frozenset(("StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit"))


class ProgramGone(BaseException):
    """The program's process closed the channel or broke the protocol: the test cannot be decided. A BaseException,
    so that a test's own ``except Exception`` does not swallow it (the judge also notices it after the test)."""


class ProgramFault(BaseException):
    """The program raised an exception with a control-flow meaning (the message is the test's failure reason). A
    BaseException, and remembered by the judge, so that no ``except`` in the test turns it into a pass."""


class NotPlainData(TypeError):
    """A value the test compares or computes with, or a method it calls, is not data the judge can hold."""


class ProgramError(Exception):
    """The program raised an exception whose type is not a builtin one (the type's name is the message)."""


# --- data ----------------------------------------------------------------------------------------------------------

_CONTAINERS = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_MAKE = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
_FACTORIES = {"int": int, "float": float, "str": str, "list": list, "dict": dict, "set": set, "tuple": tuple}


def encode(value, export=None, depth=0):
    """`value` as JSON-able data: scalars as themselves, anything else as a list whose first item names its type.
    `export(obj, depth)` gives what stands for an object that is not data (a handle); None: raise NotPlainData."""
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is float:
        return value
    if kind is int:
        return value if -_SAFE_INT < value < _SAFE_INT else ["int", hex(value)]
    if depth > _DEPTH:
        raise NotPlainData("nested too deep")
    if kind in _CONTAINERS:
        return [_CONTAINERS[kind], *(encode(item, export, depth + 1) for item in value)]
    if kind is dict:
        return ["dict", *_pairs(value, export, depth)]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind is complex:
        return ["complex", value.real, value.imag]
    if kind in _LOCAL:  # a handle: never inspected here (isinstance would ask the other side for its __class__)
        if export is None:
            raise NotPlainData(kind.__name__)
        return export(value, depth)
    data = _library_value(value, export, depth)
    if data is not None:
        return data
    if export is None:
        raise NotPlainData(kind.__name__)
    return export(value, depth)


def _pairs(mapping, export, depth):
    out = []
    for key, item in mapping.items():
        out += (encode(key, export, depth + 1), encode(item, export, depth + 1))
    return out


def _library_value(value, export, depth):
    """The data of a value of the standard library's or numpy's types (dates, Fraction, Decimal, namedtuple, enum,
    Counter, OrderedDict, defaultdict, numpy arrays and scalars), or None. Only modules already imported are looked
    at: a value of a module nobody imported cannot exist."""
    modules = sys.modules
    kind = type(value)
    dt = modules.get("datetime")
    if dt is not None and isinstance(value, dt.date | dt.time | dt.timedelta):
        if isinstance(value, dt.timedelta):
            return ["timedelta", value.days, value.seconds, value.microseconds]
        name = "datetime" if isinstance(value, dt.datetime) else "date" if isinstance(value, dt.date) else "time"
        return [name, value.isoformat()]
    fractions, decimal = modules.get("fractions"), modules.get("decimal")
    if fractions is not None and isinstance(value, fractions.Fraction):
        return ["fraction", encode(int(value.numerator)), encode(int(value.denominator))]
    if decimal is not None and isinstance(value, decimal.Decimal):
        return ["decimal", str(value)]
    enum = modules.get("enum")
    if enum is not None and isinstance(value, enum.Enum):
        return _enum_data(kind, value, export, depth)
    if isinstance(value, tuple) and type(getattr(kind, "_fields", None)) is tuple:
        fields = [str(f) for f in kind._fields]
        return ["nt", kind.__name__, fields, *(encode(item, export, depth + 1) for item in tuple.__iter__(value))]
    collections = modules.get("collections")
    if collections is not None and isinstance(value, dict):
        if isinstance(value, collections.Counter):
            return ["counter", *_pairs(value, export, depth)]
        if isinstance(value, collections.OrderedDict):
            return ["odict", *_pairs(value, export, depth)]
        if isinstance(value, collections.defaultdict):
            factory = getattr(value.default_factory, "__name__", None)
            return ["ddict", factory if factory in _FACTORIES else None, *_pairs(value, export, depth)]
    if kind.__module__ == "numpy":
        return _numpy_data(value)
    return None


def _enum_data(kind, value, export, depth):
    """An enum member by value: its class's name, base, and every member (so that members of one class compare
    equal to each other on the other side)."""
    bases = [b.__name__ for b in kind.__mro__ if b.__name__ in ("IntFlag", "Flag", "IntEnum", "StrEnum")]
    members = [[str(name), encode(member._value_, export, depth + 1)] for name, member in kind.__members__.items()]
    return ["enum", kind.__name__, bases[0] if bases else "Enum", str(value._name_), *members]


def _numpy_data(value):
    """A numpy array or scalar as dtype, shape and bytes; None for what has objects or fields in it."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or dtype.hasobject or dtype.fields is not None or not hasattr(value, "tobytes"):
        return None
    if type(value).__name__ == "ndarray":
        return ["ndarray", dtype.str, list(value.shape), value.tobytes().hex()]
    if getattr(value, "ndim", None) == 0:
        return ["npscalar", dtype.str, value.tobytes().hex()]
    return None


def decode(data, resolve, depth=0):
    """The value `data` encodes, built of the receiver's own types. `resolve(tag, items, depth)` gives what a tag that
    is not data (a handle, a reference, an iterator) stands for; it raises ProgramGone for a tag it does not know.

    Raises:
        ProgramGone: `data` is not something `encode` makes.
    """
    kind = type(data)
    if data is None or kind is bool or kind is int or kind is float or kind is str:
        return data
    if kind is not list or not data or type(data[0]) is not str or depth > _DEPTH:
        raise ProgramGone("malformed reply")
    tag, items = data[0], data[1:]
    try:
        value = _decode_tagged(tag, items, resolve, depth)
    except NotPlainData:
        raise
    except (TypeError, ValueError, RecursionError, OverflowError, ArithmeticError, AttributeError, KeyError):
        raise ProgramGone("malformed reply") from None  # an unhashable set item or key, bad hex, a bad date
    if value is _UNKNOWN:
        return resolve(tag, items, depth)
    return value


_UNKNOWN = object()


def _decode_tagged(tag, items, resolve, depth):
    inner = lambda item: decode(item, resolve, depth + 1)  # noqa: E731
    if tag in _MAKE:
        return _MAKE[tag](inner(item) for item in items)
    if tag in ("dict", "counter", "odict") and len(items) % 2 == 0:
        return _MAPPINGS[tag](_decode_pairs(items, inner))
    if tag == "ddict" and len(items) % 2 == 1 and (items[0] is None or items[0] in _FACTORIES):
        import collections

        return collections.defaultdict(_FACTORIES.get(items[0]), _decode_pairs(items[1:], inner))
    if tag == "iter":  # a materialised generator or iterator: a fresh iterator over its items
        return iter([inner(item) for item in items])
    if tag == "int" and len(items) == 1 and type(items[0]) is str:
        return int(items[0], 16)
    if tag == "bytes" and len(items) == 1 and type(items[0]) is str:
        return bytes.fromhex(items[0])
    if tag == "complex" and len(items) == 2 and all(type(x) in (int, float) for x in items):
        return complex(*items)
    if tag in ("date", "datetime", "time") and len(items) == 1 and type(items[0]) is str and len(items[0]) < 64:
        import datetime

        return getattr(datetime, tag).fromisoformat(items[0])
    if tag == "timedelta" and len(items) == 3 and all(type(x) is int for x in items):
        import datetime

        return datetime.timedelta(*items)
    if tag == "fraction" and len(items) == 2:
        import fractions

        numerator, denominator = inner(items[0]), inner(items[1])
        if type(numerator) is not int or type(denominator) is not int:
            raise ValueError("fraction")
        return fractions.Fraction(numerator, denominator)
    if tag == "decimal" and len(items) == 1 and type(items[0]) is str and len(items[0]) < 10_000:
        import decimal

        return decimal.Decimal(items[0])
    if tag == "nt" and len(items) >= 2:
        return _namedtuple(items[0], items[1])(*(inner(item) for item in items[2:]))
    if tag == "enum" and len(items) >= 3:
        return _enum(items, inner)
    if tag in ("ndarray", "npscalar"):
        return _numpy(tag, items)
    return _UNKNOWN


def _decode_pairs(items, inner):
    pairs = [inner(item) for item in items]
    return zip(pairs[::2], pairs[1::2], strict=True)


def _counter(pairs):
    import collections

    return collections.Counter(dict(pairs))


def _odict(pairs):
    import collections

    return collections.OrderedDict(pairs)


_MAPPINGS = {"dict": dict, "counter": _counter, "odict": _odict}
_made_types: dict = {}  # (kind, name, ...) -> a type built here, so that values of one type compare as one type


def _identifier(name):
    if type(name) is not str or not name.isidentifier() or name.startswith("_") or len(name) > 100:
        raise ValueError("not a name")
    return name


def _namedtuple(name, fields):
    if type(fields) is not list or len(fields) > 1000:
        raise ValueError("fields")
    key = ("nt", _identifier(name), *(_identifier(f) for f in fields))
    if key not in _made_types:
        import collections

        _made_types[key] = collections.namedtuple(name, fields)
    return _made_types[key]


def _enum(items, inner):
    import enum

    name, base, member, pairs = _identifier(items[0]), items[1], items[2], items[3:]
    if base not in ("Enum", "IntEnum", "Flag", "IntFlag", "StrEnum") or not hasattr(enum, base) or len(pairs) > 1000:
        raise ValueError("enum")
    members = []
    for pair in pairs:
        if type(pair) is not list or len(pair) != 2:
            raise ValueError("enum member")
        value = inner(pair[1])
        if type(value) not in (int, str, float, bool, type(None), tuple, bytes):
            raise ValueError("enum value")
        members.append((_identifier(pair[0]), value))
    key = ("enum", name, base, tuple(members))
    if key not in _made_types:
        _made_types[key] = getattr(enum, base)(name, members)
    return _made_types[key][member]


def _numpy(tag, items):
    """A fresh numpy array or scalar from dtype, shape and bytes; a dtype that holds objects or fields is refused."""
    try:
        import numpy
    except ImportError:
        raise NotPlainData(tag) from None
    dtype = numpy.dtype(items[0]) if type(items[0]) is str and len(items[0]) < 16 else None
    if dtype is None or dtype.hasobject or dtype.fields is not None or dtype.itemsize == 0:
        raise ValueError("dtype")
    if tag == "npscalar" and len(items) == 2 and type(items[1]) is str:
        data = bytes.fromhex(items[1])
        if len(data) != dtype.itemsize:
            raise ValueError("size")
        return numpy.frombuffer(data, dtype)[0]
    shape, hexed = items[1], items[2] if len(items) == 3 else None
    if type(shape) is not list or len(shape) > 32 or any(type(n) is not int or n < 0 for n in shape):
        raise ValueError("shape")
    data = bytes.fromhex(hexed)
    count = 1
    for n in shape:
        count *= n
    if count * dtype.itemsize != len(data):
        raise ValueError("size")
    return numpy.frombuffer(data, dtype).reshape(shape).copy()


def _lenient(value):
    """The program's side: a value as data where it is one in all but type (a str or int subclass, a numpy scalar
    of an odd dtype), else the value itself. What this does runs in the program's process and proves nothing: the
    judge checks what arrives and builds its own value."""
    kind = type(value)
    if kind in (int, float, str, bool, bytes, complex, list, tuple, dict, set, frozenset) or value is None:
        return value
    if kind.__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    for base, convert in ((bool, bool), (int, int.__int__), (float, float.__float__), (str, str.__str__),
                          (bytes, bytes), (tuple, tuple), (list, list), (dict, dict), (frozenset, frozenset),
                          (set, set)):  # fmt: skip
        if isinstance(value, base):
            return convert(value)
    return value


# --- the channel ---------------------------------------------------------------------------------------------------


class Channel:
    """Length-prefixed messages over a pipe each way. Each side writes what the other reads safely: the program's
    side writes JSON (`_json_dumps`), which the judge parses with the json module, never trusting the bytes; the
    judge writes marshal data, which only the program's side reads (nothing the program sends is ever unmarshalled).
    Neither side imports more than it needs: json and its regular expressions cost a fresh interpreter ~18 ms."""

    def __init__(self, read_fd, write_fd, dumps, loads):
        self.read_fd, self.write_fd = read_fd, write_fd
        self.dumps, self.loads = dumps, loads

    def send(self, message):
        data = self.dumps(message)
        view = memoryview(len(data).to_bytes(4, "big") + data)
        try:
            while view:
                view = view[os.write(self.write_fd, view) :]
        except OSError:
            raise ProgramGone("closed") from None

    def receive(self):
        size = int.from_bytes(self._exactly(4), "big")
        if size > MAX_MESSAGE:
            raise ProgramGone("output limit")
        try:
            return self.loads(self._exactly(size))
        except (ValueError, RecursionError, EOFError, TypeError, MemoryError):
            raise ProgramGone("malformed reply") from None

    def _exactly(self, size):
        chunks, left = [], size
        while left:
            try:
                chunk = os.read(self.read_fd, min(left, 1 << 20))
            except OSError:
                chunk = b""
            if not chunk:
                raise ProgramGone("closed")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)


def _json_dumps(message):
    """JSON text of a message made of dicts, lists, str, int, float, bool and None, without importing json."""
    out = []
    _json_emit(message, out)
    return "".join(out).encode()


def _json_emit(value, out):
    kind = type(value)
    if value is None:
        out.append("null")
    elif kind is bool:
        out.append("true" if value else "false")
    elif kind is int:
        out.append(int.__repr__(value))
    elif kind is float:
        out.append("NaN" if value != value else float.__repr__(value).replace("inf", "Infinity"))
    elif kind is str:
        out.append(_quote(value))
    elif kind is list:
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _json_emit(item, out)
        out.append("]")
    elif kind is dict:
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append("," if i else "")
            out.append(_quote(str(key)) + ":")
            _json_emit(item, out)
        out.append("}")
    else:
        raise NotPlainData(kind.__name__)


try:
    from _json import encode_basestring_ascii as _quote
except ImportError:  # an interpreter without the C accelerator
    from json.encoder import py_encode_basestring_ascii as _quote


def program_channel(read_fd, write_fd):
    """The program's end: writes JSON, reads the judge's marshal data."""
    return Channel(read_fd, write_fd, _json_dumps, marshal.loads)


def judge_channel(read_fd, write_fd):
    """The judge's end: writes marshal data, parses the program's JSON (json.loads: strict, bounded by the size cap
    and the recursion limit)."""
    import json

    return Channel(read_fd, write_fd, marshal.dumps, json.loads)


# --- the judge's handles on the program's objects ------------------------------------------------------------------

# What the judge lets the program answer for one of its objects: a method of it is called (and an item read) only
# when the row names the object's class; a callable a call returned is called; anything else is read, not asked.
NONE, CALLABLE, OBJECT = 0, 1, 2


class Remote:
    """The program's object, in the judge. Calls, attribute reads and writes, item access, iteration, len, bool, str
    and repr are asked of the program and answered with data; comparisons, arithmetic, hashing by value and
    membership use the object's data (`Peer.plain`), computed here. `_level` says what may be asked (`OBJECT`,
    `CALLABLE`, `NONE`): the program answers a call or an item with the test's own values in hand, so that is asked
    only of what the row makes the program's."""

    __slots__ = ("_peer", "_ref", "_type", "_level")

    def __init__(self, peer, ref, type_name, level):
        object.__setattr__(self, "_peer", peer)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_type", type_name)
        object.__setattr__(self, "_level", level)

    def __getattribute__(self, name):
        if name in Remote.__slots__:
            return object.__getattribute__(self, name)
        return object.__getattribute__(self, "_peer").ask("getattr", self, name=name)

    def __setattr__(self, name, value):
        self._peer.ask("setattr", self, name=name, args=(value,))

    def __call__(self, *args, **kwargs):
        _require(self, CALLABLE)
        return self._peer.ask("call", self, args=args, kwargs=kwargs)

    def __getitem__(self, key):
        _require(self, OBJECT)
        return self._peer.ask("getitem", self, args=(key,))

    def __setitem__(self, key, value):
        _require(self, OBJECT)
        self._peer.ask("setitem", self, args=(key, value))

    def __iter__(self):
        return iter(self._peer.ask("list", self))

    def __len__(self):
        return self._peer.ask("len", self)

    def __bool__(self):
        return self._peer.ask("bool", self)

    def __str__(self):
        return self._peer.ask("str", self)

    def __repr__(self):
        return self._peer.ask("repr", self)

    def __format__(self, spec):
        return format(self._peer.plain(self), spec) if spec else str(self)

    def __contains__(self, item):
        return item in list(self)

    def __hash__(self):
        return object.__hash__(self)

    def __eq__(self, other):  # never the program's __eq__: it could say yes to anything
        return self._peer.plain(self) == other

    def __ne__(self, other):
        return not self == other

    def __instancecheck__(self, obj):  # isinstance(x, Node), Node the program's class: the program's to answer
        _require(self, OBJECT)
        return self._peer.ask("isinstance", self, args=(obj,))


def _require(remote, level):
    """Refuse to ask the program what only the row's own objects are asked (`Remote`)."""
    if remote._level < level:
        raise NotPlainData(remote._type)


class ProgramIterator:
    """A generator or iterator of the program's too long to materialise: its first items came with it, each next one
    is asked for (data, or the end). The iterator protocol runs here."""

    def __init__(self, peer, ref, items):
        self._peer, self._ref, self._items = peer, ref, items

    def __iter__(self):
        return self

    def __next__(self):
        if self._items:
            return self._items.pop(0)
        return self._peer.ask("next", self)


def _plain_op(op, reflected=False):
    def method(self, *other):
        value = self._peer.plain(self)
        if reflected:
            return op(other[0], value)
        return op(value, *other)

    return method


def _add_plain_ops():
    import operator

    for name in ("lt", "le", "gt", "ge", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or",
                 "xor", "lshift", "rshift", "matmul"):  # fmt: skip
        op = getattr(operator, name if name not in ("and", "or") else name + "_")
        setattr(Remote, f"__{name}__", _plain_op(op))
        if name not in ("lt", "le", "gt", "ge"):
            setattr(Remote, f"__r{name}__", _plain_op(op, reflected=True))
    for name, op in (("neg", operator.neg), ("pos", operator.pos), ("abs", abs), ("invert", operator.invert),
                     ("int", int), ("float", float), ("complex", complex), ("index", operator.index),
                     ("round", round), ("trunc", __import__("math").trunc)):  # fmt: skip
        setattr(Remote, f"__{name}__", _plain_op(op))


_add_plain_ops()


# --- the program's handles on the judge's objects ------------------------------------------------------------------


class JudgeFunction:
    """A callable a test passed (a lambda, a function, a class, a bound method), in the program's process: calling
    it asks the judge to call it, with data, and gives back data. There is nothing else to it."""

    __slots__ = ("_peer", "_ref")

    def __init__(self, peer, ref):
        object.__setattr__(self, "_peer", peer)
        object.__setattr__(self, "_ref", ref)

    def __getattribute__(self, name):  # nothing to read: not even its (local) class
        if name in JudgeFunction.__slots__:
            return object.__getattribute__(self, name)
        raise AttributeError(name)

    def __call__(self, *args, **kwargs):
        return object.__getattribute__(self, "_peer").ask("call", self, args=args, kwargs=kwargs)

    def __repr__(self):
        return "<test's callable>"


class JudgeObject:
    """A copy, in the program's process, of an instance of a class a test's setup defines: its public attributes as
    data, its public methods as `JudgeFunction`s. Handed back to the judge, it stands for the test's own object."""


# Builtins that would run the program's data as code in the judge, or read what they are given beyond its data: a
# test that hands one to the program fails instead.
_NEVER_HANDED = (eval, exec, compile, getattr, setattr, delattr, vars, globals, locals, open, __import__, breakpoint,
                 input)  # fmt: skip
_OPS = ("call", "getattr", "setattr", "getitem", "setitem", "list", "next", "len", "bool", "str", "repr",
        "isinstance", "value")  # fmt: skip
_LOCAL = (Remote, ProgramIterator, JudgeFunction)  # handles: encoded by their reference, never inspected


class Peer:
    """One side of the channel: asks about the other side's objects and answers about its own.

    Args:
        channel: the pipes.
        names: the program's namespace, whose objects the judge may name (the program's side); None: the judge's
            side, which answers only calls of the callables it handed over and parses every reply as untrusted.
        classes: the judge's side: the names of the program's classes the row uses (their objects' methods may be
            called).
    """

    def __init__(self, channel, names=None, classes=()):
        self.channel = channel
        self.names = names
        self.judging = names is None
        self.classes = frozenset(classes)
        self.exports = []  # objects handed to the other side, by handle number
        self.exported = {}  # id(object) -> handle number
        self.remotes = {}  # the other side's handle number -> its stand-in here (so that identity holds)
        self.capture = None  # the program's side: where its stdout goes while it answers
        self.broken = None  # why the channel broke: "ended" (the other side went away), or how it broke the protocol
        self.fault = None  # the judge's side: the control-flow exception the program raised during this test
        self._level = NONE  # the judge's side: what the handles of the reply being read may be asked
        self._via = None  # the judge's side: "<type>.<attribute>" when the reply being read is an attribute's
        self._data_only = False  # the judge's side: the reply being read is an object's data: no handle in it

    # Asking.

    def ask(self, op, target, name=None, args=(), kwargs=None):
        message = {"q": op, "t": target._ref}
        if name is not None:
            message["n"] = name
        if args:
            message["a"] = [self.encode(a) for a in args]
        if kwargs:
            message["k"] = [[key, self.encode(value)] for key, value in kwargs.items()]
        try:
            self.channel.send(message)
            while True:
                reply = self.channel.receive()
                if type(reply) is not dict:
                    raise ProgramGone("malformed reply")
                if "q" not in reply:
                    return self._result(reply, op, target, name, args, kwargs)
                self.channel.send(self.answer(reply))  # the other side asks about one of ours before it answers
        except ProgramGone as err:
            self.broken = self.broken or ("ended" if str(err) == "closed" else str(err))
            raise

    def plain(self, remote):
        """The data of the program's object (NotPlainData when it is not data)."""
        return self.ask("value", remote)

    def name(self, name):
        """What stands for the program's object called `name`: its functions and classes may be called."""
        return Remote(self, ["name", name], name, OBJECT)

    def _result(self, reply, op, target, name, args, kwargs):
        written, changed = reply.get("o", ""), reply.get("w", [])
        if type(written) is not str or type(changed) is not list:
            raise ProgramGone("malformed reply")
        sys.stdout.write(written)  # what the program printed while it answered (a test may capture it)
        if self.judging:
            self._level = _reply_level(op, target)
            self._via = f"{target._type}.{name}" if op == "getattr" and type(target) is Remote else None
            self._data_only = op == "value"
        for item in changed:  # arguments the call changed in place
            if type(item) is not list or len(item) != 2:
                raise ProgramGone("malformed reply")
            where, data = item
            given = args[where] if type(where) is int and 0 <= where < len(args) else (kwargs or {}).get(where)
            _write_back(given, self.decode(data))
        if "ok" in reply:
            return self.decode(reply["ok"])
        if op == "next" and reply.get("end") is True:
            raise StopIteration
        if self.judging and reply.get("e") in CONTROL_FLOW:
            self.fault = _fault(reply.get("e"), reply.get("c"), target._type if type(target) is Remote else "")
            raise ProgramFault(self.fault)
        raise _exception(reply.get("e"), reply.get("c"))

    # Answering.

    def answer(self, message):
        """The reply to one request: {"ok": value} (with "w": arguments changed in place, "o": what was printed),
        {"end": true} (a "next" past the end), or {"e": exception type name, "c": detail}."""
        captured = None
        try:
            op = message.get("q")
            if op not in _OPS or (self.judging and op != "call"):
                raise ProgramGone("malformed request")
            target = self._target(message.get("t"))
            name = message.get("n")
            if op in ("getattr", "setattr") and type(name) is not str:
                raise AttributeError(name)
            raw_args = message.get("a") or []
            # The program's objects it passes to a test's callable: read, not asked.
            self._level, self._via, self._data_only = NONE, None, False
            args = [self.decode(a) for a in raw_args]
            kwargs = {str(k): self.decode(v) for k, v in message.get("k") or []}
            if self.capture is not None:
                captured = self.capture()
            if op == "next":
                result = next(target, _END)
                if result is _END:
                    return {"end": True}
            else:
                result = _perform(op, target, name, args, kwargs)
            reply = {"ok": self.encode(result, plain_only=op == "value")}
            if op == "call":
                changed = _changed(args, raw_args, self.encode) + _changed(kwargs, dict(message.get("k") or []),
                                                                          self.encode)  # fmt: skip
                if changed:
                    reply["w"] = changed
        except ProgramGone:
            raise
        except BaseException as err:
            reply = {"e": type(err).__name__}
            if isinstance(err, SystemExit):
                reply["c"] = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
            elif isinstance(err, NotPlainData):
                reply["c"] = str(err)[:200]
        finally:
            if captured is not None:
                text = captured()
                if text:
                    reply["o"] = text
        return reply

    def serve(self):
        """Answer requests until the other side closes the channel."""
        try:
            while True:
                message = self.channel.receive()
                if type(message) is not dict or "q" not in message:
                    return
                self.channel.send(self.answer(message))
        except ProgramGone:
            return

    def _target(self, ref):
        if type(ref) is not list or len(ref) != 2:
            raise ProgramGone("malformed request")
        tag, key = ref
        if tag == "name" and not self.judging and type(key) is str:
            if key in self.names:  # the program's own: a builtin it does not define is not its answer
                return self.names[key]
            raise NameError(key)
        if tag == "h" and type(key) is int and 0 <= key < len(self.exports):
            target = self.exports[key]
            if self.judging and not callable(target):
                raise TypeError("not callable")
            return target
        raise ProgramGone("malformed request")

    # Values both ways.

    def encode(self, value, plain_only=False):
        if plain_only:
            return encode(value, self._plain_only)
        return encode(value, self._export)

    def _plain_only(self, value, depth):
        converted = _lenient(value)
        if converted is value:
            raise NotPlainData(type(value).__name__)
        return encode(converted, self._plain_only, depth + 1)

    def _export(self, value, depth):
        kind = type(value)
        if kind in _LOCAL and value._peer is self:
            return ["ref", value._ref[1]] if value._ref[0] == "h" else ["name", value._ref[1]]
        if not self.judging and isinstance(value, JudgeObject):
            return ["ref", value.__dict__["_judge_ref"]]
        if _is_iterator(value):
            return self._iterator(value, depth)
        if self.judging:
            return self._judge_export(value, depth)
        converted = _lenient(value)
        if converted is not value:
            return encode(converted, self._export, depth + 1)
        return ["h", self._number(value), kind.__name__[:100]]

    def _iterator(self, value, depth):
        """A generator or iterator, materialised: all of it when it ends within `MAX_ITEMS` items; else the judge's
        refuses it, the program's goes as its first items and a handle for the rest."""
        items = []
        for item in value:
            items.append(encode(item, self._export, depth + 1))
            if len(items) >= MAX_ITEMS:
                if self.judging:
                    raise NotPlainData(f"an iterator of more than {MAX_ITEMS} items")
                return ["it", self._number(value), *items]
        return ["iter", *items]

    def _judge_export(self, value, depth):
        """What the program gets for a test's object that is not data: a callable as a handle it can only call; an
        instance of a class the test defines as a copy of its public attributes and methods; nothing else."""
        converted = _lenient(value)
        if converted is not value:  # a test's own subclass of a builtin type: its value
            return encode(converted, self._export, depth + 1)
        if callable(value):
            if any(value is refused for refused in _NEVER_HANDED):
                raise NotPlainData(f"{value.__name__} (a builtin the program may not call in the judge)")
            return ["fn", self._number(value)]
        kind = type(value)
        if kind.__module__ != "__test__":
            raise NotPlainData(kind.__name__)
        attributes, methods = {}, []
        for name, item in vars(value).items():
            if not name.startswith("_"):
                attributes[name] = item
        for name in dir(kind):
            if not name.startswith("_") and name not in attributes and callable(getattr(kind, name, None)):
                methods.append([name, ["fn", self._number(getattr(value, name))]])
        return ["obj", self._number(value), kind.__name__, encode(attributes, self._export, depth + 1), *methods]

    def _number(self, value):
        number = self.exported.get(id(value))
        if number is None:
            number = self.exported[id(value)] = len(self.exports)
            self.exports.append(value)
        return number

    def decode(self, data):
        return decode(data, self._resolve)

    def _resolve(self, tag, items, depth):
        if self.judging:
            return self._judge_resolve(tag, items, depth)
        key = items[0] if items else None
        if tag == "fn" and len(items) == 1 and type(key) is int:
            return self._remote(key, lambda: JudgeFunction(self, ["h", key]))
        if tag == "obj" and len(items) >= 3 and type(key) is int:
            return self._remote(key, lambda: self._judge_object(key, items[1:], depth))
        if tag == "ref" and len(items) == 1 and type(key) is int and 0 <= key < len(self.exports):
            return self.exports[key]
        if tag == "name" and len(items) == 1:
            return self._target(["name", key])
        raise ProgramGone("malformed request")

    def _judge_object(self, key, items, depth):
        kind = type(str(items[0]), (JudgeObject,), {})
        obj = kind()
        obj.__dict__.update(decode(items[1], self._resolve, depth + 1))
        for name, handle in items[2:]:
            obj.__dict__[name] = decode(handle, self._resolve, depth + 1)
        obj.__dict__["_judge_ref"] = key
        return obj

    def _judge_resolve(self, tag, items, depth):
        """The judge's reading of a reference in the program's reply: only to the program's own objects (a handle,
        an iterator) or back to what the judge itself handed over."""
        key = items[0] if items else None
        if type(key) is not int or key < 0:
            raise ProgramGone("malformed reply")
        if self._data_only and tag in ("h", "it"):
            raise NotPlainData(str(items[1])[:100] if tag == "h" and len(items) > 1 else "iterator")
        if tag == "h" and len(items) == 2 and type(items[1]) is str and len(items[1]) <= 100:
            level = OBJECT if items[1] in self.classes else self._level
            shown = self._via if self._via and level != OBJECT else items[1]  # a method: named by its object's type
            remote = self._remote(key, lambda: Remote(self, ["h", key], shown, level))
            if type(remote) is not Remote:
                raise ProgramGone("malformed reply")
            if remote._level < level:
                object.__setattr__(remote, "_level", level)
            return remote
        if tag == "it":
            values = [decode(item, self._resolve, depth + 1) for item in items[1:]]
            remote = self._remote(key, lambda: ProgramIterator(self, ["h", key], values))
            if type(remote) is not ProgramIterator:
                raise ProgramGone("malformed reply")
            return remote
        if tag == "ref" and len(items) == 1 and key < len(self.exports):
            return self.exports[key]
        raise ProgramGone("malformed reply")

    def _remote(self, key, make):
        if key not in self.remotes:
            self.remotes[key] = make()
        return self.remotes[key]


_END = object()


def _reply_level(op, target):
    """What the program's objects in its reply to `op` on `target` may be asked, unless the row names their class:
    a callable a call returns may be called (``make_adder(1)(2)``), as may a method of an object of a named class;
    nothing else, so that a proxy's ``startswith`` never sees the test's value."""
    level = getattr(target, "_level", NONE) if type(target) is Remote else NONE
    if op == "call" or (op == "getattr" and level == OBJECT):
        return CALLABLE
    return NONE


def _is_iterator(value):
    kind = type(value)
    return hasattr(kind, "__next__") and hasattr(kind, "__iter__") and kind not in _LOCAL


def _perform(op, target, name, args, kwargs):
    if op == "call":
        return target(*args, **kwargs)
    if op == "getattr":
        return getattr(target, name)
    if op == "setattr":
        return setattr(target, name, args[0])
    if op == "getitem":
        return target[args[0]]
    if op == "setitem":
        target[args[0]] = args[1]
        return None
    if op == "list":
        return list(target)
    if op == "len":
        return len(target)
    if op == "bool":
        return bool(target)
    if op == "str":
        return str(target)
    if op == "repr":
        return repr(target)
    if op == "isinstance":
        return isinstance(args[0], target)
    return target  # "value": encoded as data only


def _changed(given, sent, encode):
    """The arguments a call changed in place: (position or keyword, new value) for each list, dict or set whose
    value is not what was sent."""
    items = given.items() if isinstance(given, dict) else enumerate(given)
    out = []
    for where, value in items:
        if type(value) in (list, dict, set):
            now = encode(value)
            if now != sent[where]:
                out.append([where, now])
    return out


def _write_back(given, value):
    if type(given) is list and type(value) is list:
        given[:] = value
    elif type(given) in (dict, set) and type(value) is type(given):
        given.clear()
        given.update(value)


def _exception(name, detail):
    """The exception the other side raised, as this side raises it: the builtin type of that name, else a
    ProgramError (its message the type's name)."""
    if type(name) is not str or len(name) > 100:
        raise ProgramGone("malformed reply")
    if name == "NotPlainData":
        return NotPlainData(detail[:200] if type(detail) is str else "?")
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind()
    return ProgramError(name)


def _fault(name, detail, where):
    """The failure reason of a test in which the program raised an exception with a control-flow meaning."""
    if name == "SystemExit":
        code = detail if type(detail) is int else 1
        return f"exit code {code}" if code else "exited early"
    return f"error: {name}" + (f" (raised by {where})" if where else "")


def outcome(err):
    """A test's failure reason for the exception that ended it (the sandbox's reasons for a program that raised the
    same: `colograd.rewards.sandbox`)."""
    if isinstance(err, AssertionError):
        return "wrong answer"
    if isinstance(err, ProgramFault):
        return str(err)
    if isinstance(err, NotPlainData):
        return "not plain data: " + str(err)
    if isinstance(err, SyntaxError):
        return "syntax error"
    if isinstance(err, MemoryError) or getattr(err, "errno", None) == 12:
        return "memory"
    if getattr(err, "errno", None) == 27:
        return "file size"
    if isinstance(err, SystemExit):
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        return f"exit code {code}" if code else "exited early"
    if isinstance(err, ProgramError):
        return "error: " + str(err)
    if isinstance(err, NameError) and getattr(err, "name", None):
        return f"error: NameError ({err.name} is neither the test's, the row's, a builtin nor the program's)"
    return "error: " + type(err).__name__


# --- the two processes -----------------------------------------------------------------------------------------------

PROGRAM_FDS = (3, 4)  # the program's process reads requests on 3 and answers on 4


def serve(imports, program):
    """The program's process (its main.py calls this): run the row's imports and the program as a module named
    ``solution``, say whether that worked, then answer the judge until it closes the channel."""
    import io

    peer = Peer(program_channel(*PROGRAM_FDS), names={"__name__": "solution"})
    try:
        exec(compile(imports, "<test imports>", "exec"), peer.names)
        exec(compile(program, "solution.py", "exec"), peer.names)
        hello = {"ready": True}
    except BaseException as err:
        hello = {"failed": outcome(err)}

    def capture():
        previous, buffer = sys.stdout, io.StringIO()
        sys.stdout = buffer

        def done():
            sys.stdout = previous
            return buffer.getvalue()

        return done

    peer.capture = capture
    sys.stdout.flush()  # what the program printed at its top level, before it can be stopped
    peer.channel.send(hello)
    peer.serve()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # a stream the program replaced or closed
            pass
    os._exit(0)  # the judge is done: no need to wait for the interpreter's teardown


class _Names(dict):
    """The judge's namespace. A name is the test's own, the row's (imports, setup), a builtin, a module of the
    standard library or numpy the test uses without importing it (imported here, never the program's), or one the
    row makes the program's (`program`); any other name is a NameError."""

    def __init__(self, peer, program, modules):
        super().__init__(__name__="__test__", __builtins__=builtins)
        self._modules = dict(modules)
        for name in program:
            self[name] = peer.name(name)

    def __missing__(self, name):
        if name in self._modules:
            import importlib

            module = self[name] = importlib.import_module(self._modules[name])
            return module
        raise KeyError(name)  # a builtin, else the NameError the test fails with


def judge(job, read_fd, write_fd, report):
    """The judge's process: the row's imports and setup, then each test; `report(index, outcome)` is called once per
    test, in order, with "ok" or the failure reason ("ended": the program's process went away first).

    Args:
        job: {"imports": text, "setup": text, "tests": [text, ...], "program": [names that are the program's],
            "modules": {name: module the judge imports for it}, "classes": [the program's classes the row names]}.
    """
    peer = Peer(judge_channel(read_fd, write_fd), classes=job.get("classes") or ())
    sys.stdout = open(os.devnull, "w")  # for a test that prints, or captures what the program prints
    try:
        hello = peer.channel.receive()
        failed = None if type(hello) is dict and hello.get("ready") is True else str(hello.get("failed", "ended"))
    except (ProgramGone, AttributeError):
        failed = "ended"
    names = _Names(peer, job.get("program") or (), job.get("modules") or {})
    for where, text in (("<test imports>", job["imports"]), ("<test setup>", job["setup"])):
        if failed is None:
            failed = _run(text, where, names, peer)
            failed = failed and ("ended" if failed == "ended" else "setup: " + failed)
    for i, test in enumerate(job["tests"]):
        report(i, failed or _run(test, f"<test {i}>", names, peer) or "ok")
        if peer.broken:
            failed = peer.broken


def _run(text, where, names, peer):
    """Run a test's code in the judge's namespace: None, or why it failed ("ended" when the program's process went
    away meanwhile, "output limit" or "malformed reply" when it broke the protocol, the program's control-flow
    exception when it raised one, whatever the code did with any of these)."""
    peer.fault = None
    try:
        exec(compile(text, where, "exec"), names)
        result = None
    except ProgramGone:
        result = "ended"  # (peer.broken says why)
    except BaseException as err:
        result = outcome(err)
    return peer.broken or peer.fault or result
