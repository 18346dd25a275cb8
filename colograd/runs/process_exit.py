"""The end of a training process: what a normal exit does that matters, without the interpreter's teardown.

After a run, Python's exit spends seconds taking apart the ~4,000 modules torch, transformers and vLLM import and
the objects they hold (2.5 s a process after the tiny recipe on a 2-core CPU; the launcher waits for every rank's).
None of it writes anything. `exit_now` does the parts of an exit that do: the `atexit` handlers (logging's flush,
`weakref.finalize` callbacks such as temporary folders' removal, multiprocessing's children, trackers' uploads), the
flush of every file object still open, and the exit code; then it ends the process. Where a thread that is not a
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
    printed and exits 1), having run the `atexit` handlers and flushed every open file, but without the interpreter's
    teardown."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)  # Python's exit waits for them: so does this one
    atexit._run_exitfuncs()
    flush_open_files()
    os._exit(code)


# The buffered file objects `open` makes, by their classes: `isinstance` would ask objects that are not one for their
# `__class__`, which runs the `__getattr__` of lazy modules and proxies (1.5 s over a trained process's 800k objects;
# `issubclass` of their type, 0.2 s).
_BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def flush_open_files() -> None:
    """Flush every file object `open` made that is still open (the teardown would, as it closes them): the standard
    streams first, then any a library left open."""
    streams = [sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__]
    others = [obj for obj in gc.get_objects() if issubclass(type(obj), _BUFFERED)]
    for stream in [*streams, *others]:
        try:
            if stream is not None and not stream.closed and stream.writable():
                stream.flush()
        except (OSError, ValueError):  # a broken pipe, a file closed meanwhile: the teardown would not write either
            pass
