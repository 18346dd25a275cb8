"""The split harness for assert-style tests: the program's process computes values; a judge that never runs model
code decides each test. Standard library only: this file's source runs inside the sandbox, in both processes.

    trainer ──orders──▶ launcher ─┬─ program   the interpreter runs `serve`: the row's imports, then the completion's
                                  │            program, then answers requests about the program's objects
                                  └─ judge     `judge`: the row's imports and setup, then each test, in a namespace
                                               where every name that is not a builtin, an import or the test's own
                                               stands for the program's object of that name

The judge runs the tests as written. Whenever a test uses one of the program's objects (calls ``add(1, 2)``, reads an
attribute, iterates over it) the judge asks the program's process, which answers with plain data: None, bool, int,
float, complex, str, bytes, and lists, tuples, dicts, sets and frozensets of them (`encode`). What is not plain data
stays in the program's process and comes back as a handle the judge can call or ask about, but not compare: a
comparison, arithmetic or a membership test on it fetches its plain value, and fails the test
(``not plain data: <type>``) when there is none. The tests' expected values never leave the judge, and the program
gets nothing of the tests but the arguments they pass it, so nothing the program does can turn a wrong answer into a
pass: not an object equal to everything, not a replaced builtin, not a forged report, not a table read from the tests.

Requests go both ways over a pair of pipes, one message at a time (`Channel`): a test may hand the program an
object of its own (a lambda, an instance of a class its setup defines), and the program may call it back. The judge
answers only for objects it handed over, and reads none of their private attributes for the program.

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

MAX_MESSAGE = 16 << 20  # bytes of one message; a larger value fails its test
_DEPTH = 200  # nesting of plain data
_SAFE_INT = 1 << 53  # ints beyond this travel as hex: str(int) refuses past 4300 digits, hex does not


class ProgramGone(BaseException):
    """The program's process closed the channel or broke the protocol: the test cannot be decided. A BaseException,
    so that a test's own ``except Exception`` does not swallow it (the judge also notices it after the test)."""


class NotPlainData(TypeError):
    """A value the test compares or computes with is not plain data."""


class ProgramError(Exception):
    """The program raised an exception whose type is not a builtin one (the type's name is the message)."""


# --- plain data ----------------------------------------------------------------------------------------------------

_CONTAINERS = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_MAKE = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def encode(value, export=None, depth=0):
    """`value` as JSON-able data: scalars as themselves, anything else as a list whose first item names its type.
    `export(obj)` gives what stands for an object that is not plain data (a handle); None: raise NotPlainData."""
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
        out = ["dict"]
        for key, item in value.items():
            out += (encode(key, export, depth + 1), encode(item, export, depth + 1))
        return out
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind is complex:
        return ["complex", value.real, value.imag]
    if export is None:
        raise NotPlainData(type(value).__name__)
    return export(value)


def decode(data, resolve, depth=0):
    """The value `data` encodes. `resolve(tag, id, type_name, value)` gives the object a handle (``h``, ``name``), a
    handle with a plain value (``v``: a namedtuple, a Counter, an IntEnum) or a reference (``ref``) stands for. Builds
    only builtin types and what `resolve` returns.

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
        if tag in _MAKE:
            return _MAKE[tag](decode(item, resolve, depth + 1) for item in items)
        if tag == "dict" and len(items) % 2 == 0:
            pairs = [decode(item, resolve, depth + 1) for item in items]
            return dict(zip(pairs[::2], pairs[1::2], strict=True))
        if tag == "int" and len(items) == 1 and type(items[0]) is str:
            return int(items[0], 16)
        if tag == "bytes" and len(items) == 1 and type(items[0]) is str:
            return bytes.fromhex(items[0])
        if tag == "complex" and len(items) == 2 and all(type(x) in (int, float) for x in items):
            return complex(*items)
        if tag in ("h", "name", "ref") and len(items) == 2 and type(items[1]) is str:
            return resolve(tag, items[0], items[1], None)
        if tag == "v" and len(items) == 3 and type(items[1]) is str:
            return resolve(tag, items[0], items[1], decode(items[2], resolve, depth + 1))
    except (TypeError, ValueError, RecursionError):  # an unhashable set item or key, bad hex
        pass
    raise ProgramGone("malformed reply")


def _lenient(value):
    """The program's side: a value as plain data where it is one in all but type (a namedtuple, a Counter, an IntEnum,
    a numpy scalar), else the value itself. What this does runs in the program's process and proves nothing: the judge
    checks what arrives, and compares only the plain value."""
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


# --- the channel and the peers ---------------------------------------------------------------------------------------


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
        except (ValueError, RecursionError, EOFError, TypeError):
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


class Remote:
    """The other side's object. Calls, attribute reads and writes, item access, iteration, len, bool, str and repr
    are asked of the other side; comparisons, arithmetic, hashing by value and membership use the object's plain
    value (`Peer.plain`), computed here."""

    __slots__ = ("_peer", "_ref", "_type")

    def __init__(self, peer, ref, type_name):
        object.__setattr__(self, "_peer", peer)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_type", type_name)

    def __getattribute__(self, name):
        if name in Remote.__slots__:
            return object.__getattribute__(self, name)
        return object.__getattribute__(self, "_peer").ask("getattr", self, name=name)

    def __setattr__(self, name, value):
        self._peer.ask("setattr", self, name=name, args=(value,))

    def __call__(self, *args, **kwargs):
        return self._peer.ask("call", self, args=args, kwargs=kwargs)

    def __getitem__(self, key):
        return self._peer.ask("getitem", self, args=(key,))

    def __setitem__(self, key, value):
        self._peer.ask("setitem", self, args=(key, value))

    def __iter__(self):
        return iter(self._peer.ask("list", self))

    def __next__(self):
        return self._peer.ask("next", self)

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

    def __eq__(self, other):  # never the other side's __eq__: it could say yes to anything
        return self._peer.plain(self) == other

    def __ne__(self, other):
        return not self == other

    def __instancecheck__(self, obj):
        return self._peer.ask("isinstance", self, args=(obj,))


class _Shadowed:
    """Mixed into a builtin type: the other side's object that is plain data in all but type (a namedtuple, a Counter,
    an IntEnum, a str subclass), as its plain value, which every comparison, hash and operation uses; an attribute
    the plain value lacks (a namedtuple's field, an Enum's name) is asked of the other side."""

    def __getattr__(self, name):  # only called for what the plain value has not
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self.__dict__["_peer"].ask("getattr", self, name=name)

    @property
    def _peer(self):
        return self.__dict__["_peer"]

    @property
    def _ref(self):
        return self.__dict__["_ref"]


class _ShadowedDict(_Shadowed, dict):
    def __missing__(self, key):  # a defaultdict's or a Counter's own answer for a missing key
        return self.__dict__["_peer"].ask("getitem", self, args=(key,))


_SHADOW_TYPES = {base: type(f"_Shadowed_{base.__name__}", (_Shadowed, base), {})
                 for base in (int, float, complex, str, bytes, tuple, list, set, frozenset)}  # fmt: skip
_SHADOW_TYPES[dict] = _ShadowedDict


def _shadowed(peer, ref, value):
    kind = _SHADOW_TYPES.get(type(value))
    if kind is None:  # None and bool cannot be subclassed: the plain value is all there is
        return value
    shadow = kind(value)
    shadow.__dict__.update(_peer=peer, _ref=ref)
    return shadow


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

_OPS = ("call", "getattr", "setattr", "getitem", "setitem", "list", "next", "len", "bool", "str", "repr",
        "isinstance", "value")  # fmt: skip


class Peer:
    """One side of the channel: asks about the other side's objects and answers about its own.

    Args:
        channel: the pipes.
        names: the program's namespace, whose objects the other side may name (the program's side); None: names are
            not looked up here (the judge's side).
        lenient: encode values that are plain data in all but type as plain data (the program's side).
        guarded: answer only for objects handed over, and never with a private attribute (the judge's side).
    """

    def __init__(self, channel, names=None, lenient=False, guarded=False):
        self.channel = channel
        self.names = names
        self.lenient = lenient
        self.guarded = guarded
        self.exports = []  # objects handed to the other side, by handle number
        self.exported = {}  # id(object) -> handle number
        self.remotes = {}  # the other side's handle number -> Remote (so that identity holds)
        self.capture = None  # the program's side: where its stdout goes while it answers
        self.broken = False  # the channel broke (the other side went away or broke the protocol)

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
                    return self._result(reply, args, kwargs)
                self.channel.send(self.answer(reply))  # the other side asks about one of ours before it answers
        except ProgramGone:
            self.broken = True
            raise

    def plain(self, remote):
        """The plain value of the other side's object (NotPlainData when it has none)."""
        return self.ask("value", remote)

    def name(self, name):
        """What stands for the other side's object called `name`."""
        return Remote(self, ["name", name], name)

    def _result(self, reply, args, kwargs):
        written, changed = reply.get("o", ""), reply.get("w", [])
        if type(written) is not str or type(changed) is not list:
            raise ProgramGone("malformed reply")
        sys.stdout.write(written)  # what the program printed while it answered (a test may capture it)
        for item in changed:  # arguments the call changed in place
            if type(item) is not list or len(item) != 2:
                raise ProgramGone("malformed reply")
            where, data = item
            given = args[where] if type(where) is int and 0 <= where < len(args) else (kwargs or {}).get(where)
            _write_back(given, self.decode(data))
        if "ok" in reply:
            return self.decode(reply["ok"])
        raise _exception(reply.get("e"), reply.get("c"))

    # Answering.

    def answer(self, message):
        """The reply to one request: {"ok": value} (with "w": arguments changed in place, "o": what was printed), or
        {"e": exception type name}."""
        captured = None
        try:
            op = message.get("q")
            if op not in _OPS:
                raise ProgramGone("malformed request")
            target = self._target(message.get("t"))
            name = message.get("n")
            if op in ("getattr", "setattr") and (type(name) is not str or (self.guarded and name.startswith("_"))):
                raise AttributeError(name)
            raw_args = message.get("a") or []
            args = [self.decode(a) for a in raw_args]
            kwargs = {str(k): self.decode(v) for k, v in message.get("k") or []}
            if self.capture is not None:
                captured = self.capture()
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
                reply["c"] = str(err)
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
        if tag == "name" and self.names is not None and type(key) is str:
            if key in self.names:  # the program's own: a builtin it does not define is not its answer
                return self.names[key]
            raise NameError(key)
        if tag == "h" and type(key) is int and 0 <= key < len(self.exports):
            return self.exports[key]
        raise ProgramGone("malformed request")

    # Values both ways.

    def encode(self, value, plain_only=False):
        if plain_only:
            return encode(value, self._plain_only)
        return encode(value, self._export)

    def _plain_only(self, value):
        converted = _lenient(value) if self.lenient else value
        if converted is value:
            raise NotPlainData(type(value).__name__)
        return encode(converted, self._plain_only)

    def _export(self, value):
        if isinstance(value, Remote | _Shadowed) and value._peer is self:
            ref = value._ref
            return ["ref", ref[1], ref[0]] if ref[0] == "h" else ["name", 0, ref[1]]
        converted = _lenient(value) if self.lenient else value
        if converted is not value and type(value).__module__ == "numpy":
            return encode(converted, self._export)
        number = self.exported.get(id(value))
        if number is None:
            number = self.exported[id(value)] = len(self.exports)
            self.exports.append(value)
        if converted is not value:  # its plain value, and the object itself for what the plain value lacks
            return ["v", number, type(value).__name__, encode(converted, self._export)]
        return ["h", number, type(value).__name__]

    def decode(self, data):
        return decode(data, self._resolve)

    def _resolve(self, tag, key, type_name, value):
        if tag in ("h", "v") and type(key) is int:
            if key not in self.remotes:
                self.remotes[key] = (
                    Remote(self, ["h", key], type_name) if tag == "h" else _shadowed(self, ["h", key], value)
                )
            return self.remotes[key]
        if tag == "ref" and type(key) is int and 0 <= key < len(self.exports):
            return self.exports[key]
        if tag == "name" and self.names is not None:
            return self._target(["name", type_name])
        raise ProgramGone("malformed reply")


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
    if op == "next":
        return next(target)
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
    return target  # "value": encoded as plain data only


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
    if type(name) is not str:
        raise ProgramGone("malformed reply")
    if name == "NotPlainData":
        return NotPlainData(detail if type(detail) is str else "?")
    if name == "SystemExit":
        return SystemExit(detail if type(detail) is int else 1)
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, BaseException):
        return kind()
    return ProgramError(name)


def outcome(err):
    """A test's failure reason for the exception that ended it (the sandbox's reasons for a program that raised the
    same: `colograd.rewards.sandbox`)."""
    if isinstance(err, AssertionError):
        return "wrong answer"
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
    return "error: " + type(err).__name__


# --- the two processes -----------------------------------------------------------------------------------------------

PROGRAM_FDS = (3, 4)  # the program's process reads requests on 3 and answers on 4


def serve(imports, program):
    """The program's process (its main.py calls this): run the row's imports and the program as a module named
    ``solution``, say whether that worked, then answer the judge until it closes the channel."""
    import io

    peer = Peer(program_channel(*PROGRAM_FDS), names={"__name__": "solution"}, lenient=True)
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
    """The judge's namespace: a name that is not the test's, an import, its setup's or a builtin stands for the
    program's object of that name."""

    def __init__(self, peer, declared):
        super().__init__(__name__="__test__", __builtins__=builtins)
        self._peer = peer
        for name in declared:  # named by the row itself (HumanEval's entry_point), even if a builtin has the name
            self[name] = peer.name(name)

    def __missing__(self, name):
        if hasattr(builtins, name):
            raise KeyError(name)
        remote = self[name] = self._peer.name(name)
        return remote


def judge(job, read_fd, write_fd, report):
    """The judge's process: the row's imports and setup, then each test; `report(index, outcome)` is called once per
    test, in order, with "ok" or the failure reason ("ended": the program's process went away first).

    Args:
        job: {"imports": text, "setup": text, "tests": [text, ...], "declared": [names of the program's objects]}.
    """
    peer = Peer(judge_channel(read_fd, write_fd), guarded=True)
    sys.stdout = open(os.devnull, "w")  # for a test that prints, or captures what the program prints
    try:
        hello = peer.channel.receive()
        failed = None if type(hello) is dict and hello.get("ready") is True else str(hello.get("failed", "ended"))
    except (ProgramGone, AttributeError):
        failed = "ended"
    names = _Names(peer, job.get("declared") or ())
    for where, text in (("<test imports>", job["imports"]), ("<test setup>", job["setup"])):
        if failed is None:
            failed = _run(text, where, names, peer)
            failed = failed and ("ended" if failed == "ended" else "setup: " + failed)
    for i, test in enumerate(job["tests"]):
        report(i, failed or _run(test, f"<test {i}>", names, peer) or "ok")
        if peer.broken:
            failed = "ended"


def _run(text, where, names, peer):
    """Run a test's code in the judge's namespace: None, or why it failed ("ended" when the program's process went
    away meanwhile, whatever the code did with the error)."""
    try:
        exec(compile(text, where, "exec"), names)
        result = None
    except ProgramGone:
        result = "ended"
    except BaseException as err:
        result = outcome(err)
    return "ended" if peer.broken else result
