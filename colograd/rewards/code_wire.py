"""What crosses between the program's process and the judge (`colograd.rewards.code_harness`): plain data, and the
channel it goes over. Standard library only: this file's source runs inside the sandbox, in both processes.

The schema (`encode`, `decode`): None, bool, int, float, complex, str, bytes, lists, tuples, dicts, sets and
frozensets, dates and times, Fraction, Decimal, numpy arrays and scalars, namedtuples, enums, Counters, OrderedDicts,
defaultdicts, deques, ChainMaps, array.arrays, bytearrays, byte memoryviews (as bytes) and dict views, each rebuilt on
arrival as a fresh value of the receiver's own types; and the builtin types of that
data themselves (`int`, `str`, ... as a test passes them: ``remove_type(xs, int)``), by name, each arriving as the
receiver's own builtin type. Scalars travel as
themselves, anything else as a list whose first item names its type. What is not data is given to an `export`
function, which hands back what stands for it (a handle: `colograd.rewards.code_handles`); the receiver gives a tag
that is not data to its `resolve` function. A generator or iterator is materialised, bounded (`MAX_ITEMS`), before it
crosses.

The channel (`Channel`): length-prefixed messages over a pipe each way, bounded in size (`MAX_MESSAGE`); the
program's side writes JSON, which the judge parses as untrusted; the judge writes marshal data, which only the
program's side reads. Anything that is not what `encode` makes, or not a message of the protocol, ends the execution
for the program (`ProgramGone`).
"""

import marshal
import os
import sys

MAX_MESSAGE = 64 << 20  # bytes of one message; a larger value fails the program
MAX_ITEMS = 100_000  # items of a generator or iterator materialised before it crosses
# Nesting of data: as deep as one interpreter compares two values (its recursion limit, 1000 frames by default), so
# that a deeply nested right answer is not refused where one interpreter would have compared it.
_DEPTH = 1000
_WALK_FRAMES = 4  # frames the walks of one level of nesting take (encode's call and generator, the JSON emitter's)
_SAFE_INT = 1 << 53  # ints beyond this travel as hex: str(int) refuses past 4300 digits, hex does not


class ProgramGone(BaseException):
    """The program's process closed the channel or broke the protocol: the test cannot be decided. A BaseException,
    so that a test's own ``except Exception`` does not swallow it (the judge also notices it after the test)."""


class NotPlainData(TypeError):
    """A value the test compares or computes with, or a method it calls, is not data the judge can hold."""


class Handle:
    """What stands for an object of the other side (`colograd.rewards.code_handles`): encoded by its reference, never
    inspected (an ``isinstance`` on one would ask the other side for its ``__class__``)."""

    __slots__ = ()


# --- data ----------------------------------------------------------------------------------------------------------

_CONTAINERS = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_VIEWS = {type({}.keys()): "keys", type({}.values()): "values", type({}.items()): "items"}
# The builtin types that cross by name, as data: a test hands them to the program (``isinstance(x, data_type)`` with
# ``int`` given), a program returns them. Taken when this module loads, before any program runs: a program's own class
# named ``int``, or a rebound ``builtins.int``, is not one of them.
_TYPES = {kind.__name__: kind for kind in (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)}
_TYPE_NAMES = {kind: name for name, kind in _TYPES.items()}
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
    if kind is bytearray:
        return ["bytearray", value.hex()]
    if kind is memoryview and value.format in ("B", "b", "c") and value.c_contiguous:  # compares as its bytes
        return ["bytes", value.tobytes().hex()]
    if kind in _VIEWS:  # a dict's keys, values or items: a view of a fresh dict on the other side
        return [_VIEWS[kind], *(encode(item, export, depth + 1) for item in value)]
    if kind is complex:
        return ["complex", value.real, value.imag]
    if kind is type and value in _TYPE_NAMES:  # a class's hash and equality are its identity: no class can fake one
        return ["type", _TYPE_NAMES[value]]
    if issubclass(kind, Handle):  # never inspected here (isinstance would ask the other side for its __class__)
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
    if collections is not None and kind is collections.deque:
        return ["deque", value.maxlen, *(encode(item, export, depth + 1) for item in value)]
    if collections is not None and kind is collections.ChainMap:
        return ["chainmap", *(encode(dict(m) if isinstance(m, dict) else m, export, depth + 1) for m in value.maps)]
    array = modules.get("array")
    if array is not None and kind is array.array:
        return ["array", value.typecode, *(encode(item, export, depth + 1) for item in value.tolist())]
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
    equal to each other on the other side). The class is remembered as the one such data stands for here: a member
    that comes back (a test's own enum member, returned by the program) is then the same member, as it is in one
    interpreter, not a member of a copy (a plain Enum's members equal only themselves)."""
    bases = [b.__name__ for b in kind.__mro__ if b.__name__ in ("IntFlag", "Flag", "IntEnum", "StrEnum")]
    base = bases[0] if bases else "Enum"
    members = [[str(name), encode(member._value_, export, depth + 1)] for name, member in kind.__members__.items()]
    try:
        key = ("enum", kind.__name__, base, tuple((str(name), m._value_) for name, m in kind.__members__.items()))
        _made_types.setdefault(key, kind)
    except TypeError:  # a value that cannot be hashed: no class is rebuilt from such data either
        pass
    return ["enum", kind.__name__, base, str(value._name_), *members]


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
    if tag == "bytearray" and len(items) == 1 and type(items[0]) is str:
        return bytearray.fromhex(items[0])
    if tag == "keys":
        return {inner(item): None for item in items}.keys()
    if tag == "values":
        return {k: inner(item) for k, item in enumerate(items)}.values()
    if tag == "items":
        pairs = [inner(item) for item in items]
        if not all(type(pair) is tuple and len(pair) == 2 for pair in pairs):
            raise ValueError("items")
        return dict(pairs).items()
    if tag == "deque" and items and (items[0] is None or type(items[0]) is int):
        import collections

        return collections.deque((inner(item) for item in items[1:]), items[0])
    if tag == "chainmap":
        import collections

        maps = [inner(item) for item in items]
        if not all(type(m) is dict for m in maps):
            raise ValueError("chainmap")
        return collections.ChainMap(*maps)
    if tag == "array" and items and type(items[0]) is str and len(items[0]) == 1:
        import array

        if items[0] not in array.typecodes:
            raise ValueError("array")
        return array.array(items[0], [inner(item) for item in items[1:]])
    if tag == "type" and len(items) == 1 and type(items[0]) is str and items[0] in _TYPES:
        return _TYPES[items[0]]
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


def lenient(value):
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


class deep_enough:
    """While it is held, the interpreter's recursion limit lets `encode`, `decode` and the channel's JSON walk a value
    nested `_DEPTH` deep; restored after (the program and the test run under the interpreter's own limit)."""

    def __enter__(self):
        self.limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(self.limit, _WALK_FRAMES * _DEPTH + self.limit))

    def __exit__(self, *exc):
        sys.setrecursionlimit(self.limit)


class Channel:
    """Length-prefixed messages over a pipe each way. Each side writes what the other reads safely: the program's
    side writes JSON (`_json_dumps`), which the judge parses with the json module, never trusting the bytes; the
    judge writes marshal data, which only the program's side reads (nothing the program sends is ever unmarshalled).
    Neither side imports more than it needs: json and its regular expressions cost a fresh interpreter ~18 ms."""

    def __init__(self, read_fd, write_fd, dumps, loads):
        self.read_fd, self.write_fd = read_fd, write_fd
        self.dumps, self.loads = dumps, loads

    def send(self, message):
        with deep_enough():
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
        data = self._exactly(size)
        try:
            with deep_enough():
                return self.loads(data)
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
