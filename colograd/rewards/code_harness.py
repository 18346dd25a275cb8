"""The split harness for assert-style tests: the program's process computes values; a judge that never runs model
code decides each test. Standard library only: it runs inside the sandbox, in both processes, as four modules loaded
in the order of `MODULES`: `colograd.rewards.code_wire` (plain data, and the channel it crosses), `code_handles`
(what stands for an object of the other side), `code_peer` (each end's requests and answers), and this one (the two
processes).

    trainer ──orders──▶ launcher ─┬─ program   the interpreter runs `serve`: the row's imports, then the completion's
                                  │            program, then answers requests about the program's objects
                                  └─ judge     `judge`: the row's imports and setup, then each test, in a namespace
                                               of the judge's own: builtins, the standard library and numpy, the
                                               row's imports and setup, and for the names the row makes the
                                               program's (its entry point, the functions and classes the tests call),
                                               handles on the program's objects

Nothing live crosses. What goes either way is data (`code_wire.encode`): None, bool, int, float, complex, str, bytes,
lists, tuples, dicts, sets and frozensets, dates and times, Fraction, Decimal, numpy arrays and scalars, namedtuples,
enums, Counters, OrderedDicts and defaultdicts, each rebuilt on arrival as a fresh value of the receiver's own types
(and the builtin types of such data, by name: ``isinstance(x, int)`` works on an ``int`` a test passes):
the methods, comparisons and formatting a test runs on what the program returned are the judge's. A generator or
iterator is materialised (bounded) before it crosses. What is not data stays where it is, behind a handle: a callable
a test passes is called by the judge when the program asks (with data, for data); the program's objects answer
requests from the judge, but the judge calls a method of one only when the test built it by calling a class the row
names (never by the name its type gives), so a returned proxy cannot answer `.startswith(expected)` for the test. An
exception comes back as its builtin type's name with its arguments as data; one with a control-flow meaning
(StopIteration, GeneratorExit, SystemExit, ...) fails the test instead of ending a loop. The tests' expected values
never leave the judge, and the program gets nothing of the tests but the data they pass it.

Requests go both ways over a pair of pipes, one message at a time (`code_wire.Channel`), each bounded in size and
parsed as untrusted by the judge: anything that is not what `encode` makes ends the execution for the program
(`ProgramGone`).

A test keeps its meaning: its setup runs after the program, where the program's classes exist (MBPP's setup builds
trees of the program's ``Node``); HumanEval's ``check(candidate)`` gets the program's function; a list or dict an
argument holds comes back as the program left it (in-place sorting); what the program prints during a call reaches
the judge's ``sys.stdout`` (so a test that captures it sees it); an exception the program raises is raised in the test
as the same builtin type (``try: f(-1) except ValueError: pass``). What does not: a test that patches the program's
builtins or modules (``mock.patch``), checks identity between what it passed and what came back, or reads the
program's source (docs/rewards.md).
"""

import builtins
import os
import sys

from colograd.rewards.code_peer import Peer, ProgramError, ProgramFault
from colograd.rewards.code_wire import NotPlainData, ProgramGone, judge_channel, program_channel

# The modules of the harness, in the order they are loaded inside the sandbox (each imports only those before it):
# both processes load them as compiled code (`colograd.rewards.code_tests.compiled_harness`).
MODULES = ("code_wire", "code_handles", "code_peer", "code_harness")


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
    ``solution``, say whether that worked, then answer the judge until it closes the channel. The module is in
    sys.modules, as an imported one would be, so that pickle finds its functions by reference (what
    `multiprocessing.Pool.map(square, xs)` sends its workers)."""
    import io

    sys.modules["solution"] = solution = type(sys)("solution")
    peer = Peer(program_channel(*PROGRAM_FDS), names=solution.__dict__)
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
