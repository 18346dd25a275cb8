"""A call in the main thread that is given up on after a time limit, or soon after SIGTERM.

User code that may never return (a reward function) runs in the main thread, where it was always run: math_verify,
behind TRL's accuracy rewards, times itself with SIGALRM, which only the main thread may set. A watcher thread keeps
the time; when the limit passes, or when SIGTERM came `patience` seconds ago, it sends the main thread a signal
whose handler raises where the call is (a sleep, a socket read or a lock wait is cut short by it), and `call_within`
raises `GaveUp`. Code blocked where no signal reaches (C code that never returns to Python) cannot be stopped so:
`EXIT_GRACE` seconds later the watcher ends the process itself, with one line.
"""

import os
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

T = TypeVar("T")

# A real-time signal nothing else in a training process uses: SIGALRM is math_verify's, SIGUSR1/2 are SLURM's
# (`--signal`) and PyTorch's (c10 uses SIGUSR2 for its stack dumps). None where the platform has none: no limit.
GIVE_UP_SIGNAL: int | None = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else None
EXIT_GRACE = 5.0  # seconds the main thread gets to leave the call once interrupted, before the process ends
_POLL = 0.1  # seconds between the watcher's looks at the clock and at SIGTERM
# Folders `exit_stuck` removes: its `os._exit` skips the finalizers that would (`removed_when_stuck`).
_FOLDERS: "weakref.WeakSet[tempfile.TemporaryDirectory]" = weakref.WeakSet()
_limited_calls = 0  # calls running under a watcher now (`limited_call_running`)


class GaveUp(Exception):
    """The call was given up on.

    Args:
        reason: "timeout" (the limit passed) or "sigterm" (SIGTERM came and `patience` passed).
        running: what was running then, as `call_within`'s `running` described it.
        seconds: how long the call had run.
    """

    def __init__(self, reason: str, running: str, seconds: float) -> None:
        super().__init__(f"{running}: {reason} after {seconds:.0f} s")
        self.reason, self.running, self.seconds = reason, running, seconds


class _Interrupt(BaseException):
    """Raised in the call by the watcher's signal: a BaseException, so the call's own `except Exception` lets it
    pass."""


def call_within(
    call: Callable[[], T],
    running: Callable[[], str],
    limit: float | None,
    patience: float,
    stop_requested: Callable[[], bool],
) -> T:
    """`call()`, given up on after `limit` seconds (None: never), or `patience` seconds after `stop_requested()`
    turned true (SIGTERM).

    Off the main thread (signal handlers can only be set there) the call runs without a watcher.

    Args:
        call: what to run, in this thread.
        running: describes what is running, for the messages (asked when the call is given up on).
        limit: seconds the call may take, or None.
        patience: seconds the call may still take once `stop_requested()` is true.
        stop_requested: polled by the watcher.

    Returns:
        What `call` returned.

    Raises:
        GaveUp: the call was interrupted, for the reason it carries.
    """
    global _limited_calls
    if GIVE_UP_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return call()
    watch = _Watch(limit, patience, stop_requested, running)
    previous = signal.signal(GIVE_UP_SIGNAL, watch.interrupt)
    watch.start()
    _limited_calls += limit is not None
    try:
        return call()
    except _Interrupt:
        pass
    finally:
        _limited_calls -= limit is not None
        watch.finish()
        signal.signal(GIVE_UP_SIGNAL, previous)
    raise GaveUp(watch.reason, watch.running_then, watch.seconds)


def limited_call_running() -> bool:
    """Whether a call with a time limit runs now under `call_within` (which ends it, stuck or not, past its limit):
    `colograd.runs.hang` leaves it to that limit."""
    return _limited_calls > 0


class _Watch:
    """The watcher thread of one `call_within`."""

    def __init__(
        self, limit: float | None, patience: float, stop_requested: Callable[[], bool], running: Callable[[], str]
    ) -> None:
        self.limit, self.patience, self.stop_requested, self.running = limit, patience, stop_requested, running
        self.inside = True  # the main thread is in the call: the signal's handler raises only then
        self.done = threading.Event()
        self.reason, self.running_then, self.seconds = "", "", 0.0
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._watch, name="colograd-time-limit", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> None:
        self.inside = False
        self.done.set()

    def interrupt(self, signum: int, frame: FrameType | None) -> None:
        # A signal that arrives once the call is over (a race with `finish`) is dropped.
        if self.inside:
            raise _Interrupt

    def _watch(self) -> None:
        start, stop_at = time.monotonic(), None
        while not self.done.wait(_POLL):
            now = time.monotonic()
            if stop_at is None and self.stop_requested():
                stop_at = now
            if self.limit is not None and now - start >= self.limit:
                self.reason = "timeout"
            elif stop_at is not None and now - stop_at >= self.patience:
                self.reason = "sigterm"
            else:
                continue
            self.running_then, self.seconds = self.running(), now - start
            signal.pthread_kill(self._main, GIVE_UP_SIGNAL)
            if not self.done.wait(EXIT_GRACE):
                stopped = "SIGTERM came" if self.reason == "sigterm" else "its time limit passed"
                exit_stuck(
                    f"colograd: error: {self.running_then} did not return, {stopped}, and cannot be interrupted "
                    "(it is blocked outside Python); the process ends here, its last finished checkpoint is intact.",
                    128 + signal.SIGTERM if self.reason == "sigterm" else 1,
                )
            return


def removed_when_stuck(folder: tempfile.TemporaryDirectory) -> tempfile.TemporaryDirectory:
    """`folder`, also removed when the process ends stuck (`exit_stuck`), not only at a normal exit: the engine's
    model folder, and a LoRA adapter's, which may sit in RAM-backed /dev/shm and outlive the process there."""
    _FOLDERS.add(folder)
    return folder


def exit_stuck(message: str | None, code: int) -> None:
    """End the process from a watcher thread (`message` said first): the main thread is stuck where nothing can
    reach it."""
    try:
        if message is not None:
            print(message, file=sys.stderr, flush=True)
        for folder in list(_FOLDERS):
            try:
                folder.cleanup()
            except OSError:  # gone already, or not ours to remove
                pass
    finally:  # whatever happens above, the process ends
        os._exit(code)
