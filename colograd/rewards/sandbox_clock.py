"""What a sandboxed execution is charged while it runs: the CPU time of its whole process tree, and its wall time less
the time the sandbox's own processes waited for a CPU. `colograd.rewards.sandbox` asks between reads of the
execution's output, and kills it at either limit.

CPU time is counted over the tree, so that a program cannot hand its work on to children it keeps forking, each
under the per-process RLIMIT_CPU: from the execution's cgroup where there is one (`CgroupCpu`: the kernel counts every
process that was ever in it), else from /proc, polled (`ProcTreeCpu`).

Wall time does not count the waits for a CPU of the launcher, the sandbox's pid 1, the program's first process and
the judge (`/proc/<pid>/schedstat`), so that a busy machine does not turn a correct program into a timeout. Only
those four: what the program starts is not asked, since a program that forks runnable children would otherwise make
waits of its own to deduct. Each of the four waits at most as long as the execution lasts, and what the program's own
processes make them wait is bounded by its CPU time; whatever the waits, no execution lasts more than `BACKSTOP`
times its wall limit.
"""

import os
import time
from typing import Protocol

from colograd.rewards.sandbox_cgroup import Cgroups

BACKSTOP = 3  # whatever the waits, no execution lasts more than this many times the wall limit
POLL_S = 0.05  # seconds between readings of the tree's CPU time, once it could have reached its limit
# The namespace pids of the program's first process and the judge: the sandbox's pid 1 forks them first, in that
# order, in a pid namespace of its own (a pid is not given again before the namespace's pids wrap around).
OWN_NAMESPACE_PIDS = (2, 3)
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class TreeCpu(Protocol):
    """CPU seconds used so far by an execution's processes together, those that ended included."""

    def seconds(self) -> float: ...


class CgroupCpu:
    """The execution's cgroup's CPU accounting: exact, whatever the program's processes do."""

    def __init__(self, cgroups: Cgroups, folder: str) -> None:
        self.cgroups, self.folder = cgroups, folder

    def seconds(self) -> float:
        return self.cgroups.cpu_seconds(self.folder)


class ProcTreeCpu:
    """The tree under the launcher, read from /proc top down: each process's own CPU time and that of the children it
    has waited for (``utime + stime + cutime + cstime``). What a process that ended used is thus counted in its
    parent's (or, orphaned, in the sandbox's pid 1's, which waits for every process). Not counted: a child of a parent
    that ignores SIGCHLD (the kernel reaps it, and adds its time to no one's) after it ends, and, for a moment, a child
    that ends between the readings of its parent and of itself; the wall limit bounds what escapes so."""

    def __init__(self, root: int) -> None:
        self.root = root

    def seconds(self) -> float:
        ticks, level, seen = 0, [self.root], set()
        while level:  # parents before children: a process reaped meanwhile is missed once, never counted twice
            below = []
            for pid in level:
                if pid in seen:
                    continue
                seen.add(pid)
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rpartition(")")[2].split()
                    ticks += sum(int(n) for n in fields[11:15])  # utime, stime, cutime, cstime
                except (OSError, ValueError):
                    continue
                below += _children(pid)
            level = below
        return ticks / _TICK


class Clock:
    """The limits of one execution, read while it runs.

    Args:
        pid: the launcher's.
        isolated: whether the launcher builds a pid namespace (its one child is then the sandbox's pid 1); else the
            launcher is pid 1 itself.
        wall_s: the wall limit, waits for a CPU of the sandbox's own processes not counted.
        cpu_s: the limit on the whole tree's CPU time.
        cpu: where the tree's CPU time is read.
        cores: how many CPUs the tree can use at once: its CPU time is first read once it could have reached the limit.
    """

    def __init__(self, pid: int, isolated: bool, wall_s: float, cpu_s: float, cpu: TreeCpu, cores: int) -> None:
        self.pid, self.isolated = pid, isolated
        self.wall_s, self.cpu_s, self.cpu = wall_s, cpu_s, cpu
        self.cpu_from = cpu_s / max(1, cores)
        self.start = time.perf_counter()
        self.waited: dict[int, int] = {}  # pid -> nanoseconds spent runnable but not running
        self._own: list[int] = []

    def check(self) -> tuple[str | None, float]:
        """Why the execution must end now ("timeout", "cpu time"), or None and the seconds until the next check."""
        elapsed = time.perf_counter() - self.start
        if elapsed >= self.wall_s * BACKSTOP:
            return "timeout", 0.0
        if elapsed >= self.cpu_from:
            if self.cpu.seconds() >= self.cpu_s:
                return "cpu time", 0.0
            next_cpu = POLL_S
        else:
            next_cpu = self.cpu_from - elapsed
        if elapsed < self.wall_s:  # below the limit even with no wait deducted
            wall_left = self.wall_s - elapsed
        else:
            wall_left = self.wall_s - (elapsed - self._waited_s())
            if wall_left <= 0:
                return "timeout", 0.0
        return None, max(0.001, min(next_cpu, wall_left, self.wall_s * BACKSTOP - elapsed))

    def _waited_s(self) -> float:
        for pid in self._own_pids():
            try:
                with open(f"/proc/{pid}/schedstat") as f:
                    self.waited[pid] = max(self.waited.get(pid, 0), int(f.read().split()[1]))
            except (OSError, ValueError, IndexError):
                continue
        return sum(self.waited.values()) / 1e9

    def _own_pids(self) -> list[int]:
        """The launcher, pid 1, the program's first process and the judge, as far as they are known (once all are, no
        longer looked for)."""
        if len(self._own) == 4:
            return self._own
        own = [self.pid]
        if not self.isolated:  # the launcher is pid 1; its children are the program and the judge
            return own + _children(self.pid)[:2]
        for init in _children(self.pid)[:1]:
            own += [init, *(child for child in _children(init) if _namespace_pid(child) in OWN_NAMESPACE_PIDS)]
        self._own = own
        return own


def _children(pid: int) -> list[int]:
    """The children of every thread of `pid` (none when it is gone)."""
    found = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(child) for child in f.read().split()]
        except (OSError, ValueError):
            continue
    return found


def _namespace_pid(pid: int) -> int | None:
    """`pid`'s number in its own (innermost) pid namespace."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return None
