"""One sandbox kept for many executions of one program (`Sandbox.session`): a completion's stdin/stdout cases, or a
checker's, each case a fresh execution in a fresh /sandbox, the sandbox built once (`sandbox_launch.serve_cases`)."""

import json
import os
import selectors
import signal
import socket
import subprocess
import tempfile
import time

from colograd.rewards.sandbox import (
    _ENV,
    _STATUS_BYTES,
    _STDERR_KEPT,
    LAUNCHER,
    OVERLOADED_TRIES,
    Execution,
    Sandbox,
    _kill_group,
    _launcher_report,
    _reason,
    _stdin_file,
    _text,
    logger,
    retried,
)
from colograd.rewards.sandbox_clock import BACKSTOP, CgroupCpu, Clock, ProcTreeCpu


class Session:
    """One sandbox, many executions of one program: each `case` runs it afresh on that case's stdin (and files), with
    each case's limits (`SandboxLimits`, counted from when the case starts), and returns its `Execution`. The sandbox
    is built once: each case gets a new /sandbox, /tmp and /dev/shm, and whatever the last case left running is
    killed before the next starts (`sandbox_launch.serve_cases`). A case's input crosses only when the case runs, so
    a run that stops at its first failure never sends the rest. A case killed from here (its wall or CPU time, its
    output) ends the sandbox with it (`alive` is then False): the next case builds it again. A case the machine
    stops as overloaded runs again in a sandbox built afresh, up to OVERLOADED_TRIES tries in all, so a caller's own
    reward gets the machine's verdict taken back as the built-in ones do. A sandbox whose setup failed is not built
    again: its cases answer "sandbox setup failed".

    Use as a context manager, or `close` it.
    """

    def __init__(self, sandbox: Sandbox, code: str, argv: list[str] | None, files: dict[str, bytes] | None) -> None:
        self.sandbox = sandbox
        self._program = (code, argv, files)
        self._setup_error: str | None = None
        self._closed = False
        self._open()

    def _open(self) -> None:
        """Build the sandbox and start its launcher, which waits for cases."""
        sandbox, (code, argv, files) = self.sandbox, self._program
        self.alive = True
        self.protections: tuple[str, ...] = ()
        self._cases = 0
        self._status = bytearray()
        self._started = time.perf_counter()
        status_r, status_w = os.pipe()
        self._control, control = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._workdir = None if sandbox.isolated else tempfile.TemporaryDirectory(prefix="colograd-unsandboxed-")
        self._cgroups = sandbox._create_cgroups()
        orders = {
            "isolated": sandbox.isolated,
            "status_fd": status_w,
            "stdin_fd": None,
            "cases_fd": control.fileno(),
            "binds": sandbox._binds,
            "disk_kib": sandbox.limits.disk_mib * 1024,
            "limits": sandbox.limits.rlimits(),
            "python": sandbox.python,
            "env": _ENV if sandbox.isolated else dict(os.environ),
            "workdir": self._workdir.name if self._workdir else None,
            "code": code,
            "argv": argv,
            "files": {name: bytes(data).hex() for name, data in (files or {}).items()},
            "judge": None,
            "protections": list(sandbox._wanted) if sandbox.isolated else [],
            "cgroups": self._cgroups,
        }
        try:
            self._proc = subprocess.Popen(
                [sandbox.python, "-I", "-S", LAUNCHER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w, control.fileno()),
                env={},
                start_new_session=True,
            )
        except BaseException:  # no launcher: nothing will use the session's cgroups, folder or pipes
            os.close(status_r)
            self._control.close()
            if self._workdir is not None:
                self._workdir.cleanup()
            sandbox._remove_cgroups(self._cgroups)
            raise
        finally:
            os.close(status_w)
            control.close()
        try:
            self._proc.stdin.write(json.dumps(orders).encode())
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        limits = sandbox.limits
        cgroups, cpu = self._cgroups, sandbox._cpu_cgroups
        self._clock = Clock(self._proc.pid, sandbox.isolated, limits.wall_s, limits.tree_cpu_s(),
                            CgroupCpu(cpu, cgroups["cpu_cgroup"]) if "cpu_cgroup" in cgroups
                            else ProcTreeCpu(self._proc.pid), len(os.sched_getaffinity(0)))  # fmt: skip
        self._status_fd = status_r
        self._streams = {self._proc.stdout.fileno(): bytearray(), self._proc.stderr.fileno(): bytearray(),
                         status_r: self._status}  # fmt: skip
        for fd in self._streams:
            os.set_blocking(fd, False)
        self._selector = selectors.DefaultSelector()
        for fd in self._streams:
            self._selector.register(fd, selectors.EVENT_READ)
        self._oom = 0
        self._written = 0  # bytes the current case wrote to stdout and stderr

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def case(self, stdin: str | bytes = "", files: dict[str, str | bytes] | None = None) -> Execution:
        """Run the program once more, on `stdin`, with `files` in /sandbox beside it; never raises for what the
        program does. Where the last case ended the sandbox, or the machine stops this one as overloaded, the
        sandbox is built again first (see the class)."""
        if self._closed:  # as a program whose sandbox is gone
            return Execution("", "", None, None, "sandbox failed", seconds=0.0)
        return retried(lambda: self._case(stdin, files))

    def _case(self, stdin: str | bytes, files: dict[str, str | bytes] | None) -> Execution:
        start = time.perf_counter()
        if self._setup_error is not None:
            return Execution(
                "", f"sandbox setup: {self._setup_error}", None, None, "sandbox setup failed", seconds=0.0
            )
        if not self.alive:
            self._shut()
            self._open()
        names = list(files or {})
        fds = [_stdin_file(stdin), *(_stdin_file(data) for data in (files or {}).values())]
        try:
            socket.send_fds(self._control, [json.dumps({"files": names}).encode()], fds)
        except OSError:  # the sandbox ended (its setup failed, or it was killed): read why below
            pass
        finally:
            for fd in fds:
                os.close(fd)
        if self._cases:
            self._clock.restart()
        self._cases += 1
        out, err = self._streams[self._proc.stdout.fileno()], self._streams[self._proc.stderr.fileno()]
        out.clear()
        err.clear()
        self._written = 0
        cut, report = self._wait_for_case()
        stdout, stderr = bytes(out[: self.sandbox.limits.output_kib * 1024]), bytes(err[-_STDERR_KEPT:])
        seconds = time.perf_counter() - start
        done = dict(protections=self.protections, seconds=seconds)
        if cut is None and report is not None and "setup_error" in report:
            self._setup_error = report["setup_error"]
            self._end()
            return Execution("", f"sandbox setup: {report['setup_error']}", None, None, "sandbox setup failed", **done)
        oom = self._oom_kills()
        if cut or report is None:
            self._end()
        program = (report or {}).get("program") or {}
        exit_code, sig = program.get("exit_code"), program.get("signal")
        if cut:
            reason = cut
        elif oom and (report is None or sig == signal.SIGKILL):
            reason = "memory"
        elif report is None:
            reason = "sandbox failed"
            logger.warning("code rewards: the sandbox failed: %s", (_text(stderr).strip().splitlines() or ["no "
                           "message"])[-1])  # fmt: skip
        else:
            reason = _reason(exit_code, sig, _text(stderr))
        return Execution(_text(stdout), _text(stderr), exit_code, sig, reason, **done)

    def _oom_kills(self) -> int:
        """The memory cgroup's OOM kills since the last case asked."""
        if "memory_cgroup" not in self._cgroups:
            return 0
        total = self.sandbox._cgroups.oom_kills(self._cgroups["memory_cgroup"])
        new, self._oom = total - self._oom, total
        return new

    def _wait_for_case(self) -> tuple[str | None, dict | None]:
        """Read the streams until the status pipe says the case is done (its report), the sandbox ends (None), or
        the case must be cut ("timeout", "cpu time", "overloaded", "output limit", "status limit")."""
        cap = self.sandbox.limits.output_kib * 1024
        err = self._streams[self._proc.stderr.fileno()]
        while True:
            report = self._next_report()
            if report is not None:
                self._drain()  # the case's processes are all gone: what they wrote is in the pipes
                return (None if self._written <= cap else "output limit"), report
            if not self._selector.get_map():
                return None, None
            over, wait = self._clock.check()
            if over == "overloaded":
                logger.warning("code rewards: an execution got under 1/%d of its wall time on this machine's CPUs "
                               "and was stopped: the machine is overloaded", BACKSTOP)  # fmt: skip
            if over:
                return over, None
            for key, _ in self._selector.select(wait):
                self._read(key.fd)
            if self._written > cap:  # stdout and stderr together, stderr counted though only its end is kept
                return "output limit", None
            if len(self._status) > _STATUS_BYTES:
                return "status limit", None
            if len(err) > 2 * _STDERR_KEPT:
                del err[:-_STDERR_KEPT]

    def _next_report(self) -> dict | None:
        """The next case's report (or the setup's error) from the status pipe's complete lines; the protections'
        line is taken on the way. Lines are parsed as untrusted, within the cap."""
        while b"\n" in self._status or (self._status and self._status_fd not in self._selector.get_map()):
            line, _, rest = bytes(self._status).partition(b"\n")
            self._status[:] = rest
            try:
                report = json.loads(line) if line.strip() else None
            except (ValueError, RecursionError):
                continue
            if type(report) is not dict:
                continue
            if type(report.get("case")) is int and report["case"] == self._cases - 1:
                return {"program": _launcher_report(report).get("program", {})}
            if "setup_error" in report:
                return _launcher_report(report)
            if "protections" in report:
                self.protections = tuple(_launcher_report(report).get("protections", ()))
        return None

    def _read(self, fd: int) -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if chunk:
            self._streams[fd].extend(chunk)
            if fd != self._status_fd:
                self._written += len(chunk)
        else:
            self._selector.unregister(fd)

    def _drain(self) -> None:
        for fd in (self._proc.stdout.fileno(), self._proc.stderr.fileno()):
            while fd in self._selector.get_map():
                before = len(self._streams[fd])
                self._read(fd)
                if len(self._streams[fd]) == before:
                    break

    def _end(self) -> None:
        if self.alive:
            self.alive = False
            _kill_group(self._proc)

    def close(self) -> None:
        """End the session: the sandbox and everything in it."""
        self._closed = True
        self._shut()

    def _shut(self) -> None:
        """End the sandbox (and its launcher), keeping the session."""
        if self._proc.returncode is not None and not self.alive and self._control.fileno() < 0:
            return
        self._control.close()  # the launcher's pid 1 reads the end, and exits
        self._end()
        self._proc.wait()
        self._selector.close()
        for stream in (self._proc.stdout, self._proc.stderr):
            stream.close()
        try:
            os.close(self._status_fd)
        except OSError:
            pass
        if self._workdir is not None:
            self._workdir.cleanup()
        self.sandbox._remove_cgroups(self._cgroups)


class Overloaded(Exception):
    """A checker's execution the machine stopped as overloaded at every try: its verdict on the case is unknown, so
    the completion gets no score (not a wrong answer, and not a broken checker)."""


def said_overloaded() -> None:
    """Where a completion's execution was stopped as overloaded at every try, and its reward gives no score."""
    logger.warning("code rewards: an execution was stopped as overloaded %d times in a row; its completion gets no "
                   "code reward (None): the machine runs too much beside the training", OVERLOADED_TRIES)  # fmt: skip
