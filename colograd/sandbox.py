"""Running untrusted Python (model-written code) in isolation, from what Linux gives: namespaces and rlimits.

Each execution gets new mount, pid, network, IPC and UTS namespaces (and a user namespace when the trainer is not
root), a root of its own that holds only read-only system folders and the interpreter, a writable tmpfs
``/sandbox``, an empty environment, no capabilities, and limits on CPU time, memory, processes, open files, file
size, disk and output; wall time is kept here. When the program exits or is killed, everything it started dies
with its pid namespace. The launcher (`colograd.sandbox_launch`) does the building; this module starts it, feeds it,
reads its output within the caps and tells why an execution failed. docs/rewards.md says what this does not protect
against.

Where the isolation cannot be built, `Sandbox` refuses at construction in one line naming what is missing;
``isolated=False`` is the explicit opt-in to run programs with the rlimits and a temporary folder only.
"""

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from colograd.errors import ConfigError

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launch.py")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8"}
_STDERR_KEPT = 4096  # bytes of stderr kept for the failure's reason


class SandboxUnavailable(ConfigError):
    """The sandbox cannot be built on this machine; the message names what is missing and the opt-out."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one execution may use.

    wall_s: seconds of wall time before it is killed (open-r1 gives a test case 5).
    cpu_s: seconds of CPU time (RLIMIT_CPU, per process).
    memory_mib: address space per process (RLIMIT_AS).
    processes: processes and threads (RLIMIT_NPROC, counted within the sandbox).
    open_files: open file descriptors (RLIMIT_NOFILE).
    file_mib: largest file it may write (RLIMIT_FSIZE).
    disk_mib: size of its writable /sandbox (a tmpfs: it counts against memory).
    output_kib: stdout + stderr read before it is killed.
    """

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mib: int = 1024
    processes: int = 16
    open_files: int = 64
    file_mib: int = 16
    disk_mib: int = 16
    output_kib: int = 1024

    def rlimits(self) -> dict[str, int]:
        """The launcher's rlimits, by `resource.RLIMIT_<name>`."""
        mib = 1 << 20
        return {
            "CPU": self.cpu_s,
            "AS": self.memory_mib * mib,
            "NPROC": self.processes,
            "NOFILE": self.open_files,
            "FSIZE": self.file_mib * mib,
            "CORE": 0,
        }


@dataclass
class Execution:
    """What one execution gave.

    stdout: its standard output (up to the output cap), decoded as UTF-8 with replacement.
    stderr: the last few KiB of its standard error.
    exit_code: the program's exit status, None when a signal ended it or it was killed here.
    signal: the signal that ended it, if one did.
    reason: None when it exited 0; else why it failed: "timeout", "cpu time", "memory", "output limit",
        "syntax error", "error: <exception type>", "killed by <signal>", "exit code <n>".
    seconds: wall time of the whole execution, sandbox included.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    reason: str | None
    seconds: float = field(default=0.0, compare=False)

    @property
    def ok(self) -> bool:
        return self.reason is None


class Sandbox:
    """Runs Python programs in isolation, one process tree per execution.

    Args:
        limits: what each execution may use.
        isolated: False runs programs with the rlimits and a temporary folder only: they see the machine's files,
            network and processes. Only for trusted code, or a machine without the namespaces (docs/rewards.md).
        python: the interpreter programs run with; default: the base interpreter of this one (not its virtual
            environment). Its installation folder is made visible, read-only.

    Raises:
        SandboxUnavailable: `isolated` and the machine refuses a namespace or mount the sandbox needs.
    """

    def __init__(self, limits: SandboxLimits | None = None, isolated: bool = True, python: str | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.isolated = isolated
        self.python = os.path.realpath(python or getattr(sys, "_base_executable", sys.executable))
        if not os.access(self.python, os.X_OK):
            raise ConfigError(f"code rewards: there is no Python interpreter at {self.python}; give one that exists.")
        prefix = os.path.dirname(os.path.dirname(self.python))
        system = prefix == "/usr" or prefix.startswith(("/usr/", "/bin", "/lib"))
        self._binds = [] if system else [prefix]
        self._check()

    def _check(self) -> None:
        """Run one trivial program; refuse in one line when the sandbox cannot be built."""
        probe = self.run("print(6 * 7)")
        if probe.stdout.strip() == "42":
            return
        what = probe.stderr.strip().splitlines()[-1:] or [probe.reason or "no output"]
        raise SandboxUnavailable(
            f"code rewards: the sandbox cannot start here ({what[0]}); it needs user, mount, pid and network "
            "namespaces (as root, or with unprivileged user namespaces enabled: sysctl "
            "kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0, and no AppArmor restriction). Run "
            "where they are, or opt out of the isolation with code_sandbox: none (docs/rewards.md)."
        )

    def run(self, code: str, stdin: str = "") -> Execution:
        """Run `code` with `stdin` as its standard input; never raises for what the program does."""
        start = time.perf_counter()
        status_r, status_w = os.pipe()
        workdir = None if self.isolated else tempfile.TemporaryDirectory(prefix="colograd-unsandboxed-")
        orders = {
            "isolated": self.isolated,
            "status_fd": status_w,
            "binds": self._binds,
            "disk_kib": self.limits.disk_mib * 1024,
            "limits": self.limits.rlimits(),
            "python": self.python,
            # Unisolated, nothing is hidden: the program gets this process's environment, as a plain subprocess.
            "env": _ENV if self.isolated else dict(os.environ),
            "workdir": workdir.name if workdir else None,
            "code": code,
            "stdin": stdin,
        }
        try:
            proc = subprocess.Popen(
                [self.python, "-I", "-S", LAUNCHER],  # standard library only: any Python 3.10+ runs it
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                env={},
                start_new_session=True,  # its own process group: killed as one
            )
        finally:
            os.close(status_w)
        try:
            proc.stdin.write(json.dumps(orders).encode())
            proc.stdin.close()
            stdout, stderr, cut = _read_capped(proc, start + self.limits.wall_s, self.limits.output_kib * 1024)
            _kill_group(proc)
            proc.wait()
            with os.fdopen(status_r, "rb") as f:
                status = json.loads(f.read() or b"{}")
        finally:
            if workdir is not None:
                workdir.cleanup()
        if "setup_error" in status:
            return Execution("", f"sandbox setup: {status['setup_error']}", None, None, "sandbox setup failed")
        if not self.isolated:  # the launcher became the program: its status is the program's
            status = {"signal": -proc.returncode} if proc.returncode < 0 else {"exit_code": proc.returncode}
        text = lambda b: b.decode("utf-8", "replace")  # noqa: E731
        exit_code, sig = status.get("exit_code"), status.get("signal")
        reason = cut or _reason(exit_code, sig, text(stderr))
        return Execution(text(stdout), text(stderr), exit_code, sig, reason, time.perf_counter() - start)


def _read_capped(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, str | None]:
    """Read the program's stdout and stderr until both close, the deadline passes or together they exceed `cap`
    bytes. Returns stdout, the end of stderr, and "timeout" / "output limit" when it was cut short."""
    out, err = bytearray(), bytearray()
    total = 0
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map():
            left = deadline - time.perf_counter()
            if left <= 0:
                return bytes(out), bytes(err[-_STDERR_KEPT:]), "timeout"
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                total += len(chunk)
                key.data.extend(chunk)
                if total > cap:
                    return bytes(out[:cap]), bytes(err[-_STDERR_KEPT:]), "output limit"
                if key.data is err and len(err) > 2 * _STDERR_KEPT:
                    del err[:-_STDERR_KEPT]
    return bytes(out), bytes(err[-_STDERR_KEPT:]), None


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the launcher's process group (the launcher, the sandbox's init and, unless it left the group, the
    program); init's death ends the rest of its pid namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reason(exit_code: int | None, sig: int | None, stderr: str) -> str | None:
    """Why a finished program failed, from its status and the last line of its stderr; None when it exited 0."""
    if exit_code == 0:
        return None
    if sig is not None:
        if sig == signal.SIGXCPU:
            return "cpu time"
        if sig == signal.SIGXFSZ:
            return "file size"
        return f"killed by {signal.Signals(sig).name}" if sig in signal.Signals._value2member_map_ else f"signal {sig}"
    last = (stderr.strip().splitlines() or [""])[-1]
    kind = last.partition(":")[0].strip()
    if kind in ("SyntaxError", "IndentationError", "TabError"):
        return "syntax error"
    if kind == "MemoryError" or "[Errno 12]" in last:  # ENOMEM
        return "memory"
    if "[Errno 27]" in last:  # EFBIG: Python ignores SIGXFSZ, so the write fails instead
        return "file size"
    if kind.isidentifier() and (kind.endswith(("Error", "Exception", "Exit")) or kind == "KeyboardInterrupt"):
        return f"error: {kind}"
    return f"exit code {exit_code}"
