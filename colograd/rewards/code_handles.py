"""The handles of the split harness (`colograd.rewards.code_harness`): what stands, on one side, for an object of
the other that is not data. Standard library only: this file's source runs inside the sandbox, in both processes.

In the judge, a `Remote` stands for one of the program's objects and a `ProgramIterator` for a generator of its too
long to materialise: the judge asks the program about them, through its `colograd.rewards.code_peer.Peer`, and reads
the answers as data; comparisons, arithmetic and hashing by value run on the object's data, here. In the program's
process, a `JudgeFunction` stands for a callable a test passed (calling it asks the judge to call it) and a
`JudgeObject` is a copy of an instance of a class the test defines. No frame, attribute or object of the judge is
reachable from either.
"""

from colograd.rewards.code_wire import Handle, NotPlainData

# --- the judge's handles on the program's objects ------------------------------------------------------------------

# What the judge lets the program answer for one of its objects: a method of it is called (and an item read) only
# when the row names the object's class; a callable a call returned is called; anything else is read, not asked.
NONE, CALLABLE, OBJECT = 0, 1, 2
# The dunder attributes a test may read of the program's object: names and text, answered as data.
_TEXT_DUNDERS = ("__name__", "__qualname__", "__doc__", "__module__")


class Remote(Handle):
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
        if name[:2] == "__" == name[-2:] and name not in _TEXT_DUNDERS:
            # A protocol the judge's libraries look up (numpy's __array_interface__, copy's __deepcopy__, ...) is
            # never the program's to answer: its answer would steer them (an address numpy would read).
            raise AttributeError(name)
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


class ProgramIterator(Handle):
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


class JudgeFunction(Handle):
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
