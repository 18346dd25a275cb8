"""A hang ends: a training process that makes no progress for `hang_timeout` seconds writes every rank's Python
stacks to stderr and exits, so that the launch ends and a scheduler can relaunch it.

Progress is an optimizer step or a stage of one (generate, reward, train, save, ...) begun or ended: the stages
report it (`colograd.runs.preemption.stage_failures`). While `train` runs (`colograd.runs.preemption.Preemption`
arms it), a thread of this module keeps the time:

    no progress     past `hang_timeout`: one line naming where the rank stopped, the stacks of each of its threads
                    (faulthandler), the other ranks told through the launch's key-value store (each then writes its
                    own stacks), and the process exits with `HUNG_EXIT_CODE`
    told            another rank hung: this one writes its stacks too, and exits likewise
    interpreter     a call that never releases the interpreter (a C extension's endless loop) stops that thread
    held            too: faulthandler's own timer, `BACKSTOP` seconds later, writes the stacks and ends the process

A reward function call with a time limit of its own (`reward_timeout`, `colograd.runs.time_limit`) is left to that
limit: while one runs, the time stands still. Collectives wait `collective_timeout` seconds on every backend (gloo as
NCCL): `ddp_timeout`, raised to a minute past `hang_timeout`, so that a rank waiting for a hung one does not time
out before the hung one is reported.
"""

import faulthandler
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from colograd.runs.checkpoints import last_complete_checkpoint
from colograd.runs.time_limit import exit_stuck, limited_call_running

HUNG_EXIT_CODE = 124  # GNU timeout's: the command ran out of time
BACKSTOP = 60.0  # seconds after hang_timeout that faulthandler's own timer ends a process whose thread cannot run
COLLECTIVE_MARGIN = 60.0  # seconds a collective waits past hang_timeout
_POLL = 1.0  # seconds between the thread's looks at the clock
_STORE_POLL = 5.0  # ... and at the store, for another rank's hang
_JOIN_LIMIT = 5.0  # seconds `stop` waits for the thread to end (it ends at its next look, at once)
_STDERR = 2  # faulthandler writes to the file descriptor: sys.stderr may be replaced by one without any


def collective_timeout(ddp_timeout: float, hang_timeout: float) -> float:
    """Seconds a collective waits: `ddp_timeout`, and at least `COLLECTIVE_MARGIN` past `hang_timeout` (when on)."""
    return max(ddp_timeout, hang_timeout + COLLECTIVE_MARGIN if hang_timeout else 0.0)


class _Watch:
    """The thread that ends a process making no progress for `timeout` seconds."""

    def __init__(self, timeout: float, output_dir: str) -> None:
        self.timeout, self.output_dir = timeout, output_dir
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.store = _store()
        # A later attempt of a torchrun with restarts shares the store: its key is its own.
        self.key = f"colograd/hung/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        # What runs (a stage of a step), since when, and the last progress (which a limited call holds at "now").
        self.where, self.entered = "the start of training", time.monotonic()
        self.last = self.entered
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="colograd-hang-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()
        self.progress(None)

    def stop(self) -> None:
        self.done.set()
        faulthandler.cancel_dump_traceback_later()
        # Joined, not left to die with the process: a thread inside the store's call (which lets go of the
        # interpreter's lock) as the process exits is ended there by Python, and the process aborts.
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=_JOIN_LIMIT)

    def progress(self, where: str | None) -> None:
        with self.lock:
            self.last = time.monotonic()
            if where is not None:
                self.where, self.entered = where, self.last
        # (Re-armed at each report; a call whose own time limit watches it cancels it meanwhile, see `_run`.)
        faulthandler.dump_traceback_later(self.timeout + BACKSTOP, exit=True, file=_STDERR)

    def _run(self) -> None:
        store_at, limited = time.monotonic() + _STORE_POLL, False
        while not self.done.wait(_POLL):
            now = time.monotonic()
            if limited_call_running():  # its own limit ends it: the time stands still meanwhile
                if not limited:
                    faulthandler.cancel_dump_traceback_later()
                limited = True
                with self.lock:
                    self.last = now
            elif limited:
                limited = False
                self.progress(None)
            with self.lock:
                idle, where = now - self.last, self.where
            if idle >= self.timeout:
                self._hung(idle, where)
            if self.store is not None and now >= store_at:
                store_at = now + _STORE_POLL
                if (told := self._told()) is not None:
                    with self.lock:
                        here = f"{self.where}, for {now - self.entered:.0f} s"
                    self._end(f"colograd: error: rank {self.rank} ({here}) stops with the run, as {told}; its "
                              "stacks follow.")  # fmt: skip

    def _hung(self, idle: float, where: str) -> None:
        hung = f"rank {self.rank} made no progress for {idle:.0f} s ({where})"
        checkpoint = last_complete_checkpoint(self.output_dir)
        kept = f"the last finished checkpoint, {checkpoint}, is intact" if checkpoint else "no checkpoint was saved"
        line = (
            f"colograd: error: {hung}, more than hang_timeout ({self.timeout:g} s); the Python stacks of every rank "
            f"follow and the run ends with exit code {HUNG_EXIT_CODE} ({kept}: relaunch the same command to resume)."
        )
        if self.store is not None:
            try:
                self.store.set(self.key, hung)
            except (RuntimeError, OSError):  # the store is gone with the launch: the other ranks end with it
                pass
        self._end(line, wait=self.store is not None)

    def _told(self) -> str | None:
        """What another rank said of its hang through the store, or None."""
        try:
            return self.store.get(self.key).decode() if self.store.check([self.key]) else None
        except (RuntimeError, OSError):
            return None

    def _end(self, line: str, wait: bool = False) -> None:
        """Say `line`, write this process's stacks, and end it (after the other ranks had time to see the store's
        key and write theirs, with `wait`: the launcher stops them once this process is gone)."""
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=_STDERR, all_threads=True)
        if wait:
            time.sleep(_STORE_POLL + 2 * _POLL)
        exit_stuck(None, HUNG_EXIT_CODE)


def _store() -> dist.Store | None:
    """The default process group's key-value store (the launcher's), or None without other ranks to tell."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # a backend without one
        return None


_watch: _Watch | None = None  # the watch of the `train` call running in this process


def watch(hang_timeout: float, ddp_timeout: float, output_dir: str) -> None:
    """At the start of training: give collectives `collective_timeout` seconds (every backend), and, with a
    `hang_timeout`, watch this process for progress until `stop`."""
    global _watch
    stop()
    if dist.is_initialized():
        # transformers gives gloo torch's default (30 min) whatever ddp_timeout says; NCCL gets ddp_timeout.
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=collective_timeout(ddp_timeout, hang_timeout)))
    if hang_timeout > 0:
        _watch = _Watch(hang_timeout, output_dir)
        _watch.start()


def stop() -> None:
    """At the end of training, however it ends."""
    global _watch
    if _watch is not None:
        _watch.stop()
        _watch = None


def progress(where: str | None = None) -> None:
    """Report progress; `where` names what runs from now on (e.g. "optimizer step 3, stage 'reward'")."""
    if _watch is not None:
        _watch.progress(where)
