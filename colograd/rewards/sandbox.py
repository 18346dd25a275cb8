"""Running untrusted Python (model-written code) in isolation, from what Linux gives: namespaces, rlimits, a memory
cgroup, a seccomp filter.

Each execution gets new mount, pid, network, IPC and UTS namespaces (and a user namespace when the trainer is not
root), a root of its own that holds only read-only system folders and the interpreter, a writable tmpfs
``/sandbox``, an empty environment, a new empty session keyring, no capabilities, a seccomp filter that refuses what
a scored program never needs, a memory cgroup bounding everything it allocates, and limits on CPU time, memory,
processes, open files, file size, disk and output; the CPU time of its whole process tree and its wall time are kept
here (`colograd.rewards.sandbox_clock`). When the program exits or is killed, everything it started dies with its pid
namespace. The launcher (`colograd.rewards.sandbox_launch`) does the building; this module starts it, feeds it, reads
its output within the caps and tells why an execution failed. `Sandbox.run` is one execution; `Sandbox.session` keeps
one sandbox for many executions of one program (a completion's stdin/stdout cases), each in a fresh folder.
docs/rewards.md has the threat model: what is enforced, by which mechanism, and what is not.

Where the isolation cannot be built, `Sandbox` refuses at construction in one line naming what is missing;
``isolated=False`` is the explicit opt-in to run programs with the rlimits and a temporary folder only. Where one of
the further protections is missing (no writable cgroup, no libseccomp), it says once, in one line, what is then not
enforced.
"""

import copy
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

from colograd.errors import ConfigError
from colograd.rewards.sandbox_cgroup import Cgroups, CpuCgroups, MemoryCgroups
from colograd.rewards.sandbox_clock import BACKSTOP, CgroupCpu, Clock, ProcTreeCpu

logger = logging.getLogger(__name__)

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launch.py")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8"}
_STDERR_KEPT = 4096  # bytes of stderr kept for the failure's reason
# Bytes of the status pipe read before the execution is killed: the launcher's report and one line per test (each at
# most ~250 bytes). The judge writes it; it is parsed as untrusted all the same, within this cap.
_STATUS_BYTES = 64 << 10
_STATUS_BYTES_PER_TEST = 512
# The protections beyond the namespaces, each one a layer a test removes to show what it holds
# (tests/rewards/test_sandbox.py).
PROTECTIONS = ("memory_cgroup", "cpu_cgroup", "seccomp", "session_keyring", "ipc_limits")
_MISSING = {
    "memory_cgroup": "memory is bounded per process (RLIMIT_AS), not for the whole execution (no writable memory "
    "cgroup: the trainer is not root)",
    "cpu_cgroup": "CPU time over the process tree is read from /proc, so a child of a parent that ignores SIGCHLD "
    "escapes it once it ends (no writable cpuacct cgroup: the trainer is not root)",
    "seccomp": "no seccomp filter (libseccomp2 is not installed or the kernel refuses seccomp): ptrace, keyrings, "
    "bpf, inotify, netlink, System V IPC and memory files are not refused",
    "session_keyring": "programs keep the trainer's session keyring (keyctl is refused here)",
    "ipc_limits": "the IPC namespace's shared memory is not limited",
}
# An execution stopped as "overloaded" (it got under 1/BACKSTOP of its wall time on the machine's CPUs: the machine's
# doing, not the program's) runs again, up to this many tries in all; still overloaded, a reward gives no score.
OVERLOADED_TRIES = 3
_said: set[str] = set()
_said_lock = threading.Lock()


# The wall time the start-up probe (one trivial program) may take, whatever the run's own limit.
_PROBE_WALL_S = 60.0


class SandboxUnavailable(ConfigError):
    """The sandbox cannot be built on this machine; the message names what is missing and the opt-out."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one execution may use.

    wall_s: seconds of wall time before it is killed, from when the program has started (building the sandbox is
        not its time), not counting the time the sandbox waited for a CPU (its own processes' waits, or its whole
        tree's stalls: a pool's workers too), so that the verdict does not depend on the machine's load (on a busy
        machine a program that computes is bound by `cpu_s`; this catches programs that sleep or wait); whatever the
        waits, it ends at 20 times this after the launcher started (`colograd.rewards.sandbox_clock.BACKSTOP`), as
        "overloaded", not "timeout": only a machine that gives the execution under a twentieth of its time gets there.
    cpu_s: seconds of CPU time, for each process (RLIMIT_CPU) and for all of the execution's processes together (its
        cgroup's CPU accounting, else read from /proc), besides what the sandbox's own processes use.
    memory_mib: address space per process (RLIMIT_AS) and, with a memory cgroup, all the execution's memory
        together (its processes, shared memory, its files in /sandbox), besides what the sandbox's own processes use.
    processes: processes and threads (RLIMIT_NPROC, counted within the sandbox).
    open_files: open file descriptors (RLIMIT_NOFILE).
    file_mib: largest file it may write (RLIMIT_FSIZE).
    disk_mib: size of its writable /sandbox (a tmpfs: it counts against memory).
    output_kib: stdout + stderr read before it is killed.
    stack_mib: its stack (RLIMIT_STACK); None: the trainer's (8 MiB by default). Judges of competitive programming
        give the stack all the memory (`ulimit -s unlimited`), so that deep recursion is not a runtime error.
    """

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mib: int = 1024
    processes: int = 16
    open_files: int = 64
    file_mib: int = 16
    disk_mib: int = 16
    output_kib: int = 1024
    stack_mib: int | None = None

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
            **({} if self.stack_mib is None else {"STACK": self.stack_mib * mib}),
        }

    def tree_cpu_s(self) -> float:
        """CPU seconds all of the execution's processes may use together: the program's, and room for the launcher,
        the sandbox's init and the judge (each a small interpreter; the judge imports what the row's tests do)."""
        return self.cpu_s + SANDBOX_OWN_CPU_S

    def cgroup_bytes(self) -> int:
        """The execution's memory cgroup limit: the program's memory and disk, and room for the launcher, the sandbox's
        init and the judge (each a small interpreter)."""
        return (self.memory_mib + self.disk_mib + SANDBOX_OWN_MIB) << 20


SANDBOX_OWN_MIB = 64
SANDBOX_OWN_CPU_S = 0.5


@dataclass
class Execution:
    """What one execution gave.

    stdout: its standard output (up to the output cap), decoded as UTF-8 (invalid bytes replaced).
    stderr: the last few KiB of its standard error.
    exit_code: the program's exit status, None when a signal ended it or it was killed here.
    signal: the signal that ended it, if one did.
    reason: None when it exited 0 (or was stopped once its judge had decided every test); else why it failed:
        "timeout", "cpu time", "memory", "output limit", "syntax error", "error: <exception type>", "overloaded"
        (the machine's doing: `SandboxLimits.wall_s`),
        "killed by <signal>", "exit code <n>", or the sandbox's own: "sandbox setup failed", "sandbox failed".
    seconds: wall time of the whole execution, sandbox included.
    verdicts: with a judge, each test's outcome by index ("ok", a failure reason, or "ended": decided by the
        program's end); a test missing from it was not reached.
    judge_failure: with a judge, why it did not finish (its own error or its limits), else None.
    protections: the protections the launcher applied (`PROTECTIONS`), reported before the program starts: an
        execution killed from outside (a timeout, the CPU time or output limit) reports them too.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    reason: str | None
    seconds: float = field(default=0.0, compare=False)
    verdicts: dict[int, str] = field(default_factory=dict, compare=False)
    judge_failure: str | None = field(default=None, compare=False)
    protections: tuple[str, ...] = field(default=(), compare=False)

    @property
    def ok(self) -> bool:
        return self.reason is None


def retried(execute: Callable[[], Execution]) -> Execution:
    """`execute()`, again while the machine stops it as overloaded, up to OVERLOADED_TRIES tries; the last execution.
    Each try is a fresh execution, so a program's verdict is still its own: only the machine's is not taken."""
    execution = execute()
    for _ in range(OVERLOADED_TRIES - 1):
        if execution.reason != "overloaded":
            break
        execution = execute()
    return execution


class Sandbox:
    """Runs Python programs in isolation, one process tree per execution.

    Args:
        limits: what each execution may use.
        isolated: False runs programs with the rlimits and a temporary folder only: they see the machine's files,
            network and processes. Only for trusted code, or a machine without the namespaces (docs/rewards.md).
        python: the interpreter programs run with; default: the base interpreter of this one (not its virtual
            environment). Its installation folder is made visible, read-only.
        protections: which of `PROTECTIONS` to apply beyond the namespaces; None: every one this machine allows
            (what it does not allow is said once, in one line). Tests give fewer, to show what each one holds.

    Raises:
        SandboxUnavailable: `isolated` and the machine refuses a namespace or mount the sandbox needs.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        isolated: bool = True,
        python: str | None = None,
        protections: Collection[str] | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.isolated = isolated
        self.python = os.path.realpath(python or getattr(sys, "_base_executable", sys.executable))
        if not os.access(self.python, os.X_OK):
            raise ConfigError(f"code rewards: there is no Python interpreter at {self.python}; give one that exists.")
        unknown = set(protections or ()) - set(PROTECTIONS)
        if unknown:
            raise ConfigError(f"sandbox protections: {sorted(unknown)} are not among {', '.join(PROTECTIONS)}.")
        prefix = os.path.dirname(os.path.dirname(self.python))
        system = prefix == "/usr" or prefix.startswith(("/usr/", "/bin", "/lib"))
        self._binds = [] if system else [prefix]
        wanted = PROTECTIONS if protections is None else tuple(protections)
        self._cgroups = MemoryCgroups.find() if isolated and "memory_cgroup" in wanted else None
        self._cpu_cgroups = _cpu_cgroups(self._cgroups) if isolated and "cpu_cgroup" in wanted else None
        found = {"memory_cgroup": self._cgroups, "cpu_cgroup": self._cpu_cgroups}
        self._wanted = tuple(p for p in wanted if found.get(p, True) is not None)
        self.python_path: list[str] = []
        self.protections: tuple[str, ...] = ()
        self._check(say_missing=protections is None)

    def _check(self, say_missing: bool) -> None:
        """Run one trivial program; refuse in one line when the sandbox cannot be built; learn the interpreter's
        module path (the judge's) and which protections hold."""
        # The probe's own limits, not the run's: a run may allow a second, and an interpreter's start on a loaded
        # machine can take longer; a slow start is not a missing namespace.
        limits, self.limits = self.limits, replace(self.limits, wall_s=max(self.limits.wall_s, _PROBE_WALL_S))
        try:
            probe = self.run("import json, sys\nprint(json.dumps(sys.path))")
        finally:
            self.limits = limits
        try:
            self.python_path = json.loads(probe.stdout)
        except ValueError:
            what = probe.stderr.strip().splitlines()[-1:] or [probe.reason or "no output"]
            raise SandboxUnavailable(
                f"code rewards: the sandbox cannot start here ({what[0]}); it needs user, mount, pid and network "
                "namespaces (as root, or with unprivileged user namespaces enabled: sysctl "
                "kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0, and no AppArmor restriction). Run "
                "where they are, or opt out of the isolation with code_sandbox: none (docs/rewards.md)."
            ) from None
        self.protections = probe.protections
        if "cpu_cgroup" not in self.protections:  # made but not joined: the CPU time is read from /proc instead
            self._cpu_cgroups = None
        missing = [p for p in PROTECTIONS if p not in self.protections]
        if self.isolated and say_missing and missing:
            line = "code rewards: not enforced on this machine: " + "; ".join(_MISSING[p] for p in missing) + "."
            with _said_lock:
                if line not in _said:
                    _said.add(line)
                    logger.warning(line)

    def with_limits(self, limits: SandboxLimits) -> "Sandbox":
        """This sandbox with other limits (a problem's time and memory), without probing the machine again."""
        other = copy.copy(self)
        other.limits = limits
        return other

    def run(self, code: str, stdin: str | bytes = "", judge: dict | None = None) -> Execution:
        """Run `code` with `stdin` as its standard input; never raises for what the program does. An execution the
        machine stops as overloaded runs again, afresh, up to OVERLOADED_TRIES tries in all (its reason stays
        "overloaded" only when every try was).

        Args:
            code: the program (its main.py).
            stdin: its standard input (text is encoded as UTF-8, lone surrogates kept as their bytes), any size.
            judge: for assert-style tests, the judge's job (`colograd.rewards.code_harness.judge`; "harness": the
                harness's modules, compiled: `colograd.rewards.code_tests.compiled_harness`): it runs beside the
                program, which then gets the judge's channel and no stdin.
        """
        return retried(lambda: self._run_once(code, stdin, judge))

    def _run_once(self, code: str, stdin: str | bytes, judge: dict | None) -> Execution:
        start = time.perf_counter()
        status_r, status_w = os.pipe()
        stdin_fd = _stdin_file(stdin)
        workdir = None if self.isolated else tempfile.TemporaryDirectory(prefix="colograd-unsandboxed-")
        cgroups = self._create_cgroups()
        orders = {
            "isolated": self.isolated,
            "status_fd": status_w,
            "stdin_fd": stdin_fd,
            "binds": self._binds,
            "disk_kib": self.limits.disk_mib * 1024,
            "limits": self.limits.rlimits(),
            "python": self.python,
            # Unisolated, nothing is hidden: the program gets this process's environment, as a plain subprocess.
            "env": _ENV if self.isolated else dict(os.environ),
            "workdir": workdir.name if workdir else None,
            "code": code,
            "judge": None if judge is None else {**judge, "path": self.python_path},
            "protections": list(self._wanted) if self.isolated else [],
            "cgroups": cgroups,
        }
        try:
            proc = subprocess.Popen(
                [self.python, "-I", "-S", LAUNCHER],  # standard library only: any Python 3.10+ runs it
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w, stdin_fd),
                env={},
                start_new_session=True,  # its own process group: killed as one
            )
        finally:
            os.close(status_w)
            os.close(stdin_fd)
        try:
            try:
                proc.stdin.write(json.dumps(orders).encode())
                proc.stdin.close()
            except BrokenPipeError:  # the launcher died before reading its orders: reported below
                pass
            cpu = self._cpu_cgroups
            limits = self.limits
            clock = Clock(proc.pid, self.isolated, limits.wall_s, limits.tree_cpu_s(),
                          CgroupCpu(cpu, cgroups["cpu_cgroup"]) if "cpu_cgroup" in cgroups else ProcTreeCpu(proc.pid),
                          len(os.sched_getaffinity(0)), judge is not None)  # fmt: skip
            status_cap = _STATUS_BYTES + _STATUS_BYTES_PER_TEST * len((judge or {}).get("tests", ()))
            stdout, stderr, status_bytes, cut = _communicate(
                proc, status_r, clock, self.limits.output_kib * 1024, status_cap
            )
            _kill_group(proc)
            proc.wait()
            oom = self._cgroups.oom_kills(cgroups["memory_cgroup"]) if "memory_cgroup" in cgroups else 0
        finally:
            if workdir is not None:
                workdir.cleanup()
            self._remove_cgroups(cgroups)
        tests = len((judge or {}).get("tests", ()))
        return _execution(stdout, stderr, status_bytes, cut, oom, time.perf_counter() - start, tests)

    def session(self, code: str, argv: list[str] | None = None, files: dict[str, bytes] | None = None):
        """A sandbox kept for many executions of `code` (`Session`): one per completion, however many cases it has.

        Args:
            code: the program (its main.py).
            argv: what runs instead of ``python main.py`` (a compiled checker: ``["/sandbox/checker", ...]``).
            files: more of the program's files, put in /sandbox for every case (a compiled checker), executable.
        """
        from colograd.rewards.sandbox_session import Session  # it builds on this module's helpers

        return Session(self, code, argv, files)

    def _create_cgroups(self) -> dict[str, str]:
        """The execution's cgroups, by protection (a v2 memory cgroup counts the CPU time too)."""
        made = {}
        if self._cgroups is not None:
            made["memory_cgroup"] = self._cgroups.create(self.limits.cgroup_bytes())
        if self._cpu_cgroups is not None:
            shared = self._cpu_cgroups is self._cgroups
            made["cpu_cgroup"] = made["memory_cgroup"] if shared else self._cpu_cgroups.create(0)
        return made

    def _remove_cgroups(self, made: dict[str, str]) -> None:
        for name, folder in made.items():
            if name == "memory_cgroup":
                self._cgroups.remove(folder)
            elif folder != made.get("memory_cgroup"):
                self._cpu_cgroups.remove(folder)


def _cpu_cgroups(memory: MemoryCgroups | None) -> Cgroups | None:
    """Where the executions' CPU time is counted: in their memory cgroups when those are v2 (a process is in one v2
    cgroup only, and each counts its CPU time), else in cgroups of cgroup v1's cpuacct hierarchy or of v2."""
    if memory is not None and memory.version == 2:
        return memory
    return CpuCgroups.find()


def _status(status_bytes: bytes, tests: int) -> tuple[dict, dict[int, str], str | None]:
    """The launcher's report, the judge's verdicts and the judge's failure, read from the status pipe's lines as
    untrusted: a line that is not one of the three shapes fails the judge (and so every test it did not decide). The
    launcher reports in two lines: the protections in force, before the program starts, then how its processes
    ended (which a killed execution never writes)."""
    verdicts: dict[int, str] = {}
    status: dict = {}
    judge_failure = None
    for line in status_bytes.decode("utf-8", "replace").splitlines():
        try:
            report = json.loads(line) if line.strip() else None
        except (ValueError, RecursionError):
            report = None
        if type(report) is not dict:
            judge_failure = judge_failure or "judge: malformed status"
        elif type(report.get("test")) is int and 0 <= report["test"] < tests and type(report.get("outcome")) is str:
            verdicts.setdefault(report["test"], report["outcome"][:200])
        elif type(report.get("judge_error")) is str:
            judge_failure = f"judge: {report['judge_error'][:500]}"
        elif "setup_error" in report or "program" in report or "protections" in report:
            status.update(_launcher_report(report))
        else:
            judge_failure = judge_failure or "judge: malformed status"
    return status, verdicts, judge_failure


def _launcher_report(report: dict) -> dict:
    """The launcher's report, keeping only fields of the types it writes."""
    given = report.get("protections")
    out: dict = {}
    if type(given) is list:
        out["protections"] = [p for p in given if p in PROTECTIONS]
    if "setup_error" in report:
        out["setup_error"] = str(report["setup_error"])[:500]
    for who in ("program", "judge"):
        given = report.get(who)
        if type(given) is dict:
            out[who] = {k: v for k, v in given.items() if type(v) in (int, float, bool)}
    return out


def _execution(
    stdout: bytes, stderr: bytes, status_bytes: bytes, cut: str | None, oom: int, seconds: float, tests: int = 0
):
    """The Execution that the streams and the status pipe's lines tell of."""
    status, verdicts, judge_failure = _status(status_bytes, tests)
    err_text = _text(stderr)
    done = dict(protections=tuple(status.get("protections", ())), verdicts=verdicts, seconds=seconds)
    if "setup_error" in status:
        return Execution("", f"sandbox setup: {status['setup_error']}", None, None, "sandbox setup failed", **done)
    program = status.get("program")
    judge = status.get("judge")
    if judge is not None and judge_failure is None and (judge.get("signal") or judge.get("exit_code")):
        judge_failure = "judge: " + (_reason(judge.get("exit_code"), judge.get("signal"), "") or "failed")
    exit_code, sig = (program or {}).get("exit_code"), (program or {}).get("signal")
    if cut:
        reason = cut
    elif oom and (program is None or sig == signal.SIGKILL):
        reason = "memory"  # the kernel killed a process for the cgroup's limit
    elif program is None:
        reason = "sandbox failed"  # the launcher or init ended without reporting: not the program's doing
        logger.warning("code rewards: the sandbox failed: %s", (err_text.strip().splitlines() or ["no message"])[-1])
    elif program.get("stopped"):
        reason = None
    else:
        reason = _reason(exit_code, sig, err_text)
    return Execution(_text(stdout), err_text, exit_code, sig, reason, judge_failure=judge_failure, **done)


def _stdin_file(stdin: str | bytes) -> int:
    """A file holding `stdin`, read from its start: the program reads it as a file of the right size, whatever its
    size, and nothing here waits for it to be read."""
    data = stdin.encode("utf-8", "surrogatepass") if isinstance(stdin, str) else bytes(stdin)
    fd = os.memfd_create("colograd-stdin") if hasattr(os, "memfd_create") else _unlinked_file()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _unlinked_file() -> int:
    fd, path = tempfile.mkstemp(prefix="colograd-stdin-")
    os.unlink(path)
    return fd


def _text(data: bytes) -> str:
    """Bytes as text: UTF-8, with lone surrogates kept (a program may echo one back), else invalid bytes replaced."""
    try:
        return data.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return data.decode("utf-8", "replace")


def _communicate(proc: subprocess.Popen, status_fd: int, clock: Clock, cap: int, status_cap: int = _STATUS_BYTES):
    """Read the program's stdout and stderr and the status pipe until all close, the clock runs out, stdout and
    stderr together exceed `cap` bytes or the status pipe `status_cap`. Returns stdout, the end of stderr, the status
    pipe's bytes, and "timeout" / "cpu time" / "overloaded" / "output limit" / "status limit" when it was cut
    short."""
    out, err, status = bytearray(), bytearray(), bytearray()
    total = 0
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        sel.register(status_fd, selectors.EVENT_READ, status)
        try:
            while sel.get_map():
                over, wait = clock.check()
                if over == "overloaded":
                    logger.warning("code rewards: an execution got under 1/%d of its wall time on this machine's "
                                   "CPUs and was stopped: the machine is overloaded", BACKSTOP)  # fmt: skip
                if over:
                    return bytes(out), bytes(err[-_STDERR_KEPT:]), bytes(status), over
                for key, _ in sel.select(wait):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    if key.data is status:
                        status.extend(chunk)
                        if len(status) > status_cap:
                            return bytes(out), bytes(err[-_STDERR_KEPT:]), bytes(status[:status_cap]), "status limit"
                        continue
                    total += len(chunk)
                    key.data.extend(chunk)
                    if total > cap:
                        return bytes(out[:cap]), bytes(err[-_STDERR_KEPT:]), bytes(status), "output limit"
                    if key.data is err and len(err) > 2 * _STDERR_KEPT:
                        del err[:-_STDERR_KEPT]
        finally:
            os.close(status_fd)
    return bytes(out), bytes(err[-_STDERR_KEPT:]), bytes(status), None


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
