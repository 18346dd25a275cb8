"""The end of a training process: what a normal exit does that matters, without the interpreter's teardown.

After a run, Python's exit spends seconds taking apart the ~4,000 modules torch, transformers and vLLM import and
the objects they hold (2.5 s a process after the tiny recipe on a 2-core CPU; the launcher waits for every rank's).
None of it writes anything. `exit_now` does the parts of an exit that do: the `atexit` handlers (logging's flush,
`weakref.finalize` callbacks such as temporary folders' removal, multiprocessing's children, trackers' uploads), the
writing out of every file object still open, and the exit code; then it ends the process. Where a thread that is not a
daemon still runs (an exit waits for it), it exits as Python does.

Only a script's end calls it (`colograd/train.py`, through `run_then_exit`): in a notebook or under a test runner the
process is not ours to end.
"""

import atexit
import gc
import io
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def run_then_exit(entry: Callable[[], object]) -> NoReturn:
    """`entry()`, then the process ends with the exit code Python would give it (`exit_now`); an exception other than
    `SystemExit` propagates, and Python prints it and exits as usual."""
    try:
        entry()
    except SystemExit as stop:
        exit_now(stop.code)
    exit_now(0)


def exit_now(code: int | str | None = 0) -> NoReturn:
    """End the process with `code` as `sys.exit(code)` would (None exits 0; anything else not an int, a message, is
    printed and exits 1), having run the `atexit` handlers and written out every file still open, but without the
    interpreter's teardown."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)  # Python's exit waits for them: so does this one
    atexit._run_exitfuncs()
    write_out_open_files()
    os._exit(code)


# Every file object of the io module and of its subclasses (`open`'s, gzip's, bz2's, a library's own), found by the
# class of its type: `isinstance` would ask objects that are not one for their `__class__`, which runs the
# `__getattr__` of lazy modules and proxies (1.45 s over a trained process's 800k objects; the whole write-out
# with this, 0.2 s).
_FILE = io.IOBase.__mro__[1]  # `_io._IOBase`, the C base every io class derives from


def _closing_order(stream: io.IOBase) -> int:
    """Python-level streams first (a compressed stream writes its trailer into the file it wraps as it closes), then
    text files, buffers, raw files: a wrapper before what it wraps."""
    if type(stream).__module__ != "_io":
        return 0
    return {"TextIOWrapper": 1, "BufferedWriter": 2, "BufferedRandom": 2}.get(type(stream).__name__, 3)


def write_out_open_files() -> None:
    """Write out every file object still open for writing, as the teardown would as it deletes them: every one
    flushed (a flush hands a wrapper's data down to what it wraps, in any order), then every one but the standard
    streams closed, which writes what a compressed stream writes only as it closes."""
    streams = [s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s is not None]
    # The standard streams, their buffers and raw files stay open: a last line may still be written after this.
    buffers = [getattr(s, "buffer", None) for s in streams]
    standard = {id(f) for f in [*streams, *buffers, *(getattr(b, "raw", None) for b in buffers)] if f is not None}
    others = [obj for obj in gc.get_objects() if issubclass(type(obj), _FILE) and id(obj) not in standard]
    flushes = [s.flush for s in streams + others]
    closes = [o.close for o in sorted(others, key=_closing_order)]
    for write in flushes + closes:
        try:
            if not write.__self__.closed and write.__self__.writable():
                write()
        except (OSError, ValueError):  # a broken pipe, a file closed or detached meanwhile: the teardown would not
            pass  # write either
