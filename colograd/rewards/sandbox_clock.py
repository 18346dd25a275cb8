"""What a sandboxed execution is charged while it runs: the CPU time of its whole process tree, and its wall time less
the time the sandbox's own processes waited for a CPU. `colograd.rewards.sandbox` asks between reads of the
execution's output, and kills it at either limit.

CPU time is counted over the tree, so that a program cannot hand its work on to children it keeps forking, each
under the per-process RLIMIT_CPU: from the execution's cgroup where there is one (`CgroupCpu`: the kernel counts every
process that was ever in it), else from /proc, polled (`ProcTreeCpu`).

Wall time starts once the sandbox's own processes are all there: the launcher, the sandbox's pid 1, the program's first
process and the judge (at the latest once the limit has passed since the launch: a program whose first process forks
and exits at once is never seen there). Before, the sandbox is being built, and on a busy machine that can sleep in the
kernel for a second (joining a cgroup and detaching the old root wait for RCU grace periods; a fork waits while another
sandbox joins its cgroup), none of it the program's doing. From then on it does not count the time the sandbox waited
for a CPU: the waits of those four (`/proc/<pid>/schedstat`), or the stalls of its whole tree, every thread of every
process (a pool's workers), whichever is more (`Clock._stalls`), so that a busy machine does not turn a correct program
into a timeout. The kernel adds a wait there only once it ends, so a wait under way is watched too: a task runnable at
two readings that used no CPU in between waited all that while (a program or judge just forked on a busy machine was
seen to wait over a second before it first ran, its schedstat saying 0). The tree's stall is the time it would not have
needed on a machine of its own, with as many CPUs as it wanted at once up to `cores`: children a program keeps runnable
beside each other, more than the cores, wait on each other, not on the machine, and buy no wall time; and the program
cannot lower its own scheduling (the seccomp filter refuses it). What the program's own processes make the four wait is
bounded by its CPU time. Whatever the waits, no execution lasts more than `BACKSTOP` times its wall limit:
"overloaded", the machine's doing, not "timeout" (a fixed 3 times made a correct program's verdict depend on the
machine's load).
"""

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from colograd.rewards.sandbox_cgroup import Cgroups

BACKSTOP = 20  # whatever the waits, no execution lasts more than this many times the wall limit ("overloaded")
POLL_S = 0.05  # seconds between readings of the waits, and of the tree's CPU time once it could have reached its limit
# The namespace pids of the judge and the program's first process (without a judge, the program is 2): the sandbox's
# pid 1 forks them in that order before anything else runs in its pid namespace (`sandbox_launch.init`), so nothing
# the program forks can take either number.
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
        ticks = 0
        for pid in _tree(self.root):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
                ticks += sum(int(n) for n in fields[11:15])  # utime, stime, cutime, cstime
            except (OSError, ValueError):
                continue
        return ticks / _TICK


@dataclass
class _Reading:
    """One task's scheduling, read at `when` (`time.perf_counter`)."""

    cpu_ns: int  # its CPU time
    delay_ns: int  # its waits for a CPU that have ended (schedstat)
    runnable: bool
    when: float
    waiting_s: float = 0.0  # how long, as far as readings show, it has been runnable without running

    def waited_s(self) -> float:
        return self.delay_ns / 1e9 + self.waiting_s

    def follow(self, last: "_Reading | None") -> "_Reading":
        """This reading, with the wait under way that it and `last` show: runnable at both with no CPU time used
        and no wait ended between, it never ran, so it never slept either."""
        if last and last.runnable and self.runnable and (last.cpu_ns, last.delay_ns) == (self.cpu_ns, self.delay_ns):
            self.waiting_s = last.waiting_s + (self.when - last.when)
        return self


class Clock:
    """The limits of one execution, read while it runs.

    Args:
        pid: the launcher's.
        isolated: whether the launcher builds a pid namespace (its one child is then the sandbox's pid 1); else the
            launcher is pid 1 itself.
        wall_s: the wall limit, counted from when the sandbox's own processes are all there, the time the sandbox
            waited for a CPU not counted.
        cpu_s: the limit on the whole tree's CPU time.
        cpu: where the tree's CPU time is read.
        cores: how many CPUs the tree can use at once: its CPU time is first read once it could have reached the
            limit, and its processes together are not owed more CPUs than these.
        judge: whether a judge runs beside the program (assert-style tests).
    """

    def __init__(
        self, pid: int, isolated: bool, wall_s: float, cpu_s: float, cpu: TreeCpu, cores: int, judge: bool = False
    ) -> None:
        self.pid, self.isolated, self.judge = pid, isolated, judge
        self.wall_s, self.cpu_s, self.cpu = wall_s, cpu_s, cpu
        self.cores = max(1, cores)
        self.cpu_from = cpu_s / self.cores
        self.created = time.perf_counter()
        self.start: float | None = None  # when the wall clock started
        self.own_count = (2 if judge else 1) + (2 if isolated else 1)  # launcher, pid 1, judge, program
        self.waited_before = 0.0  # seconds the sandbox had waited by then
        self.readings: dict[int, _Reading] = {}  # pid -> the latest reading of an own process
        self.tasks: dict[int, _Reading] = {}  # tid -> the latest reading of each task (thread) of the tree
        self.stalled_s = 0.0  # the tree's stalls so far (`_stalls`)
        self.cpu_before = 0.0  # the tree's CPU seconds before the current case (`restart`)
        self._own: list[int] = []

    def restart(self) -> None:
        """Start the limits again for the next case of a session (`colograd.rewards.sandbox_session.Session`): its
        wall time and CPU time from now, what the sandbox waited and used before not its."""
        now = time.perf_counter()
        self.waited_before = self._waited_s(now)
        self.created = self.start = now
        self.cpu_before = self.cpu.seconds()

    def check(self) -> tuple[str | None, float]:
        """Why the execution must end now ("timeout", "cpu time", "overloaded"), or None and the seconds until the
        next check."""
        now = time.perf_counter()
        elapsed = now - self.created
        if elapsed >= self.wall_s * BACKSTOP:
            return "overloaded", 0.0
        if elapsed >= self.cpu_from:
            if self.cpu.seconds() - self.cpu_before >= self.cpu_s:
                return "cpu time", 0.0
            next_check = POLL_S
        else:
            next_check = min(POLL_S, self.cpu_from - elapsed)
        waited = self._waited_s(now)
        if self.start is None and len(self._own) == self.own_count:
            self.start, self.waited_before = now, waited
        elif self.start is None and elapsed >= self.wall_s:
            # They never all appeared (a program whose first process forked and exited at once): counted from the
            # launch, as if building the sandbox had taken the whole limit, not left to the backstop.
            self.start, self.waited_before = self.created, 0.0
        if self.start is None:
            wall_left = self.wall_s - elapsed
        else:
            wall_left = self.wall_s - (now - self.start - (waited - self.waited_before))
            if wall_left <= 0:
                return "timeout", 0.0
        return None, max(0.001, min(next_check, wall_left, self.wall_s * BACKSTOP - elapsed))

    def _waited_s(self, now: float) -> float:
        """Seconds the sandbox has waited for a CPU: the waits of its own processes (those that ended, and those under
        way as far as readings show; a process gone keeps its last reading), or the stalls of its whole tree, whichever
        is more."""
        for pid in self._own_pids():
            reading = _read(pid, now)
            if reading is not None:
                self.readings[pid] = reading.follow(self.readings.get(pid))
        own = sum(r.waited_s() for r in self.readings.values())
        self.stalled_s += self._stalls(now)
        return max(own, self.stalled_s)

    def _stalls(self, now: float) -> float:
        """The seconds since the last reading that the tree's tasks (every thread of every process: a pool's workers
        too) waited for a CPU, counted as the time the tree would not have needed on a machine of its own.

        Over the interval, each task was runnable for its CPU time plus its waits (`demand`); the tree was busy at
        least as long as its busiest task, `busy`, and wanted `demand / busy` CPUs at once on average, of which it is
        owed at most `cores`. On a machine of its own it would have done the CPU work it did in `cpu / owed` seconds:
        the rest of `busy` is a stall. One task: its waits. Workers that each waited half the time on a machine busy
        with other work: half the interval, as they would have run in parallel. Children the program forks to wait
        beside each other (more runnable tasks than cores): no stall, as the CPUs were all the tree's. Taking the
        busiest task's time for `busy` never counts more than the stall (the stall grows with `busy`); tasks that ran
        one after another (the judge and the program taking turns) are the own processes' waits, counted whole."""
        demand = cpu = busy = 0.0
        seen = {}
        for tid in _tasks(self.pid):
            reading = _read_task(tid, now)
            if reading is None:
                continue
            last = self.tasks.get(tid)
            seen[tid] = reading.follow(last)
            if last is None:  # first seen: what it did before it was seen was in another interval
                continue
            used = max(0.0, (reading.cpu_ns - last.cpu_ns) / 1e9)
            waited = max(0.0, reading.waited_s() - last.waited_s())
            span = min(now - last.when, used + waited)
            demand += span
            cpu += min(used, span)
            busy = max(busy, span)
        self.tasks = seen
        if busy <= 0.0:
            return 0.0
        owed = min(demand / busy, self.cores)
        return max(0.0, busy - cpu / owed)

    def _own_pids(self) -> list[int]:
        """The launcher, pid 1, the judge and the program's first process, as far as they are known (once all are, no
        longer looked for)."""
        if len(self._own) == self.own_count:
            return self._own
        own = [self.pid]
        if not self.isolated:  # the launcher is pid 1; its children are the judge and the program
            own += _children(self.pid)[: self.own_count - 1]
        else:
            wanted = OWN_NAMESPACE_PIDS[: 2 if self.judge else 1]
            for init in _children(self.pid)[:1]:
                own += [init, *(child for child in _children(init) if _namespace_pid(child) in wanted)]
        self._own = own
        return own


def _read(pid: int, now: float) -> _Reading | None:
    """`pid`'s scheduling now, or None when it is gone (or the kernel keeps no schedstat)."""
    try:
        cpu_ns = time.clock_gettime_ns(~pid << 3 | 2)  # the process's CPU clock (clock_getcpuclockid's number)
        with open(f"/proc/{pid}/stat") as f:
            runnable = f.read().rpartition(")")[2].split()[0] == "R"
        with open(f"/proc/{pid}/schedstat") as f:
            delay_ns = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return _Reading(cpu_ns, delay_ns, runnable, now)


def _read_task(tid: int, now: float) -> _Reading | None:
    """Task (thread) `tid`'s scheduling now, from its schedstat: its CPU time and its waits that ended."""
    try:
        with open(f"/proc/{tid}/task/{tid}/schedstat") as f:
            cpu_ns, delay_ns = (int(n) for n in f.read().split()[:2])
        with open(f"/proc/{tid}/task/{tid}/stat") as f:
            runnable = f.read().rpartition(")")[2].split()[0] == "R"
    except (OSError, ValueError, IndexError):
        return None
    return _Reading(cpu_ns, delay_ns, runnable, now)


def _tasks(root: int) -> list[int]:
    """Every thread of every process in the tree under `root` (the sandbox's pid 1 reaps orphans: they stay in it)."""
    found = []
    for pid in _tree(root):
        try:
            found += [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except (OSError, ValueError):
            continue
    return found


def _tree(root: int) -> Iterator[int]:
    """`root` and the processes under it, read from /proc parents before children: a process reaped meanwhile is
    missed once, never counted twice (a process gone has no children to list)."""
    level, seen = [root], set()
    while level:
        below = []
        for pid in level:
            if pid in seen:
                continue
            seen.add(pid)
            yield pid
            below += _children(pid)
        level = below


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
