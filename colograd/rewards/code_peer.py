"""Each end of the split harness's channel (`colograd.rewards.code_harness`): a `Peer` asks about the other side's
objects and answers about its own, one request at a time. Standard library only: this file's source runs inside the
sandbox, in both processes.

The judge's peer answers only calls of the callables it handed over, and parses every reply as untrusted: a reply
becomes data of the judge's own types, or a handle (`colograd.rewards.code_handles`) whose level says what the judge
may ask of it (a method of a program's object is called only when the test built it by calling a class the row
names). An exception comes back as its builtin type's name and its arguments as data (its message); one with a
control-flow meaning (`CONTROL_FLOW`) fails the test instead of ending its loop (`ProgramFault`).
"""

import builtins
import sys

from colograd.rewards.code_handles import (
    CALLABLE,
    NONE,
    OBJECT,
    JudgeFunction,
    JudgeObject,
    ProgramIterator,
    Remote,
)
from colograd.rewards.code_wire import (
    MAX_ITEMS,
    NotPlainData,
    ProgramGone,
    _json_dumps,
    decode,
    deep_enough,
    encode,
    lenient,
)

# Exceptions whose meaning is control flow: raised by the program, they fail the test rather than end its loop.
CONTROL_FLOW = frozenset(("StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit"))
MAX_EXCEPTION_ARGS = 64 << 10  # bytes of an exception's arguments as they cross; larger ones go as its text only


class ProgramFault(BaseException):
    """The program raised an exception with a control-flow meaning (the message is the test's failure reason). A
    BaseException, and remembered by the judge, so that no ``except`` in the test turns it into a pass."""


class ProgramError(Exception):
    """The program raised an exception whose type is not a builtin one (the type's name is the message)."""


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
            self._level = _reply_level(op, target, self.classes)
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
        raise _exception(reply.get("e"), reply.get("c"), self._exception_args(reply.get("m")))

    def _exception_args(self, data):
        """The arguments of the program's exception (its message), read as data only: none when they are not."""
        if data is None or not self.judging:
            return ()
        self._data_only = True
        try:
            args = self.decode(data)
        except NotPlainData:
            return ()
        if type(args) is not tuple:
            raise ProgramGone("malformed reply")
        return args

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
            elif not self.judging:  # the program's exception's message (the judge's never goes to the program)
                reply["m"] = _message(err, self._plain_only)
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
        with deep_enough():
            return encode(value, self._plain_only if plain_only else self._export)

    def _plain_only(self, value, depth):
        converted = lenient(value)
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
        converted = lenient(value)
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
        converted = lenient(value)
        if converted is not value:  # a test's own subclass of a builtin type: its value
            return encode(converted, self._export, depth + 1)
        if callable(value):
            if any(value is refused for refused in _NEVER_HANDED):
                raise NotPlainData(f"{value.__name__} (a builtin the program may not call in the judge)")
            if isinstance(value, type) and issubclass(value, type):  # `type`, any metaclass: a class from data
                raise NotPlainData(f"{value.__name__} (it would build, in the judge, a class of the program's design)")
            return ["fn", self._number(value)]
        if type(value).__module__ != "__test__":
            raise NotPlainData(type(value).__name__)
        return self._graph(value, depth)

    def _graph(self, root, depth):
        """A test's object, and every object of the test's classes reachable from it (through their attributes and
        the lists, tuples, sets and dicts in them), as one flat list: each object's number, class name, public
        attributes and public methods, an object of the graph in an attribute standing as ["objref", its number].
        So a graph crosses by identity, not by nesting: a cycle is one reference, and a linked list of any length
        is as deep as one node (`MAX_ITEMS` objects at most)."""
        members = {id(root): root}
        order, stack = [root], [root]
        while stack:
            for item in _test_objects_in(_public_attributes(stack.pop()).values()):
                if id(item) not in members:
                    if len(order) >= MAX_ITEMS:
                        raise NotPlainData(f"an object graph of more than {MAX_ITEMS} objects")
                    members[id(item)] = item
                    order.append(item)
                    stack.append(item)

        def export(value, at):
            if members.get(id(value)) is value:
                return ["objref", self._number(value)]
            return self._export(value, at)

        described = []
        for obj in order:
            kind = type(obj)
            attributes = _public_attributes(obj)
            methods = [
                [name, ["fn", self._number(getattr(obj, name))]]
                for name in dir(kind)
                if not name.startswith("_") and name not in attributes and callable(getattr(kind, name, None))
            ]
            described.append([self._number(obj), kind.__name__, encode(attributes, export, depth + 1), *methods])
        return ["graph", self._number(root), *described]

    def _number(self, value):
        number = self.exported.get(id(value))
        if number is None:
            number = self.exported[id(value)] = len(self.exports)
            self.exports.append(value)
        return number

    def decode(self, data):
        with deep_enough():
            return decode(data, self._resolve)

    def _resolve(self, tag, items, depth):
        if self.judging:
            return self._judge_resolve(tag, items, depth)
        key = items[0] if items else None
        if tag == "fn" and len(items) == 1 and type(key) is int:
            return self._remote(key, lambda: JudgeFunction(self, ["h", key]))
        if tag == "graph" and len(items) >= 2 and type(key) is int:
            return self._judge_objects(key, items[1:], depth)
        if tag == "objref" and len(items) == 1 and type(key) is int and isinstance(self.remotes.get(key), JudgeObject):
            return self.remotes[key]
        if tag == "ref" and len(items) == 1 and type(key) is int and 0 <= key < len(self.exports):
            return self.exports[key]
        if tag == "name" and len(items) == 1:
            return self._target(["name", key])
        raise ProgramGone("malformed request")

    def _judge_objects(self, root, described, depth):
        """The copies of a test's object graph (`_graph`): every object made first, then their attributes filled in,
        so that a reference to any of them (a cycle, the next node) is the copy itself. An object copied before keeps
        its copy."""
        fresh = []
        for item in described:
            if type(item) is not list or len(item) < 3 or type(item[0]) is not int:
                raise ProgramGone("malformed request")
            key = item[0]
            if key not in self.remotes:
                obj = self.remotes[key] = type(str(item[1]), (JudgeObject,), {})()
                obj.__dict__["_judge_ref"] = key
                fresh.append((obj, item))
        for obj, item in fresh:
            obj.__dict__.update(decode(item[2], self._resolve, depth + 1))
            for name, handle in item[3:]:
                obj.__dict__[name] = decode(handle, self._resolve, depth + 1)
            obj.__dict__["_judge_ref"] = item[0]
        found = self.remotes.get(root)
        if not isinstance(found, JudgeObject):
            raise ProgramGone("malformed request")
        return found

    def _judge_resolve(self, tag, items, depth):
        """The judge's reading of a reference in the program's reply: only to the program's own objects (a handle,
        an iterator) or back to what the judge itself handed over."""
        key = items[0] if items else None
        if type(key) is not int or key < 0:
            raise ProgramGone("malformed reply")
        if self._data_only and tag in ("h", "it"):
            raise NotPlainData(str(items[1])[:100] if tag == "h" and len(items) > 1 else "iterator")
        if tag == "h" and len(items) == 2 and type(items[1]) is str and len(items[1]) <= 100:
            # What the reply op grants (a callable a call returned may be called) is the reply's own: a handle inside
            # data (a namedtuple's field, a list's item) is read, never called, whatever its field is named.
            level = self._level if depth == 0 else NONE
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


def _reply_level(op, target, classes):
    """What the program's object that is the reply to `op` on `target` may be asked, by where it came from, never by
    what it says it is: what the test built by calling a class the row names (``Stack()``) is that class's object,
    whose methods may be called; a callable a call returns may be called (``make_adder(1)(2)``), as may a method of
    such an object; nothing else, so that a proxy's ``startswith`` never sees the test's value, whatever its type is
    named (an object a function returns under the name of the row's class is read as data). Objects inside the
    reply's data get none of it (`_judge_resolve`): a namedtuple's callable field is never called."""
    level = getattr(target, "_level", NONE) if type(target) is Remote else NONE
    if op == "call" and level == OBJECT and target._ref[0] == "name" and target._ref[1] in classes:
        return OBJECT
    if op == "call" or (op == "getattr" and level == OBJECT):
        return CALLABLE
    return NONE


def _public_attributes(obj):
    """A test's object's attributes whose names do not start with an underscore."""
    return {name: item for name, item in vars(obj).items() if not name.startswith("_")}


def _test_objects_in(values):
    """The objects of the test's classes among `values` and in the lists, tuples, sets and dicts among them (walked
    without recursion, each container once), as `Peer._judge_export` would copy them (not callables, not values of
    a builtin type)."""
    stack, seen, found = list(values), set(), []
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind in (list, tuple, set, frozenset, dict):
            if id(value) not in seen:
                seen.add(id(value))
                stack += [*value.keys(), *value.values()] if kind is dict else value
        elif kind.__module__ == "__test__" and not callable(value) and lenient(value) is value:
            found.append(value)
    return found


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


def _message(err, export):
    """An exception's arguments as data (``ValueError("negative")``: ``("negative",)``), else its text alone, within
    `MAX_EXCEPTION_ARGS` bytes; None when even its text cannot be had. Runs in the program's process: what it sends
    is read as data only."""
    for args in (lambda: tuple(err.args), lambda: (str(err)[:1000],)):
        try:
            data = encode(args(), export)
            if len(_json_dumps(data)) <= MAX_EXCEPTION_ARGS:
                return data
        except BaseException:
            pass
    return None


def _exception(name, detail, args=()):
    """The exception the other side raised, as this side raises it: the builtin type of that name with `args` (data
    only), else a ProgramError (its message the type's name)."""
    if type(name) is not str or len(name) > 100:
        raise ProgramGone("malformed reply")
    if name == "NotPlainData":
        return NotPlainData(detail[:200] if type(detail) is str else "?")
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(*args)
        except Exception:  # arguments its constructor refuses (UnicodeDecodeError wants five): the type, bare
            err = kind.__new__(kind)
            err.args = args
            return err
    return ProgramError(name)


def _fault(name, detail, where):
    """The failure reason of a test in which the program raised an exception with a control-flow meaning."""
    if name == "SystemExit":
        code = detail if type(detail) is int else 1
        return f"exit code {code}" if code else "exited early"
    return f"error: {name}" + (f" (raised by {where})" if where else "")
