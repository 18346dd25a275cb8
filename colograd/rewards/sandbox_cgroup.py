"""The cgroups of a sandboxed execution: a memory cgroup, the bound on everything its processes allocate together,
and a CPU-accounting cgroup, the count of the CPU time they use together.

RLIMIT_AS bounds one process's address space, and nothing else: not the tree of processes a program starts, nor
System V shared memory, memory files, pipes or the files it writes into its tmpfs. A memory cgroup bounds them all.
RLIMIT_CPU likewise counts one process: a program that hands its work on to children it keeps forking is never
stopped by it. A cgroup's CPU accounting counts every process that was ever in it, whether it was waited for or not.

`colograd.rewards.sandbox` makes them for each execution under the trainer's own cgroups (cgroup v1's memory and
cpuacct hierarchies, or v2: the memory controller where it is enabled for the trainer's children; a v2 cgroup's
``cpu.stat`` needs no controller), the launcher joins them before it builds anything, and the trainer removes them
once the execution's processes are gone. Where no such cgroup can be made (a trainer that is not root and has no
delegated cgroup), `find` returns None and the sandbox says, once, what is then bounded otherwise.
"""

import atexit
import itertools
import os
import threading
import time

_names = itertools.count()
_lock = threading.Lock()


class Cgroups:
    """Makes and removes the executions' cgroups under `root` (a folder of cgroup `version` 1 or 2), and reads the
    CPU time their processes used."""

    CONTROLLER = ""  # the v1 hierarchy looked for

    def __init__(self, root: str, version: int) -> None:
        self.root = root
        self.version = version
        self._leftovers: list[str] = []  # folders whose processes were still exiting when removed
        atexit.register(self._retry_leftovers, wait_s=0.5)  # the last executions' folders, as the trainer ends

    @classmethod
    def find(cls, versions: tuple[int, ...] = (1, 2)) -> "Cgroups | None":
        """The trainer's own cgroup of this kind, of one of `versions`, if it may make children in it; else None."""
        for root, version in _candidates(cls.CONTROLLER):
            if version not in versions:
                continue
            try:
                cgroups = cls(root, version)
                cgroups.remove(cgroups.create(64 << 20))  # a probe: made, set up and removed
            except OSError:
                continue
            cgroups._remove_stale()
            return cgroups
        return None

    def _remove_stale(self) -> None:
        """Remove the empty cgroups a trainer that has ended left behind (killed between an execution and its
        cgroup's removal)."""
        for name in os.listdir(self.root):
            parts = name.split("-")
            if len(parts) == 4 and name.startswith("colograd-sandbox-") and parts[2].isdigit():
                try:
                    os.kill(int(parts[2]), 0)
                except ProcessLookupError:
                    try:
                        os.rmdir(os.path.join(self.root, name))
                    except OSError:
                        pass
                except OSError:
                    pass

    def create(self, limit_bytes: int) -> str:
        """A new cgroup, set up for an execution that may use `limit_bytes` of memory."""
        self._retry_leftovers()
        with _lock:
            folder = os.path.join(self.root, f"colograd-sandbox-{os.getpid()}-{next(_names)}")
        os.mkdir(folder)
        try:
            self._set_up(folder, limit_bytes)
        except OSError:
            os.rmdir(folder)
            raise
        return folder

    def _set_up(self, folder: str, limit_bytes: int) -> None:
        pass

    def cpu_seconds(self, folder: str) -> float:
        """CPU time used by every process that was in `folder` (cgroup v1's cpuacct, or v2's ``cpu.stat``); 0.0 when
        it cannot be read (the folder is gone)."""
        try:
            if self.version == 1:
                with open(os.path.join(folder, "cpuacct.usage")) as f:
                    return int(f.read()) / 1e9
            with open(os.path.join(folder, "cpu.stat")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "usage_usec":
                        return int(value) / 1e6
        except (OSError, ValueError):
            pass
        return 0.0

    def remove(self, folder: str) -> None:
        """Remove `folder`, or, while its last killed processes are still exiting, leave it to the next `create` (the
        execution does not wait for them)."""
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            pass
        except OSError:  # EBUSY
            with _lock:
                self._leftovers.append(folder)

    def _retry_leftovers(self, wait_s: float = 0.0) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            with _lock:
                leftovers, self._leftovers = self._leftovers, []
            for folder in leftovers:
                try:
                    os.rmdir(folder)
                except FileNotFoundError:
                    pass
                except OSError:
                    with _lock:
                        self._leftovers.append(folder)
            if not self._leftovers or time.monotonic() >= deadline:
                return
            time.sleep(0.01)


class MemoryCgroups(Cgroups):
    """Memory cgroups: each limited to the execution's memory (and, where there is swap accounting, memory + swap)."""

    CONTROLLER = "memory"

    def _set_up(self, folder: str, limit_bytes: int) -> None:
        if self.version == 1:
            _write(folder, "memory.limit_in_bytes", limit_bytes)
            if os.path.exists(os.path.join(folder, "memory.memsw.limit_in_bytes")):
                _write(folder, "memory.memsw.limit_in_bytes", limit_bytes)
        else:
            _write(folder, "memory.max", limit_bytes)
            if os.path.exists(os.path.join(folder, "memory.swap.max")):
                _write(folder, "memory.swap.max", 0)

    def oom_kills(self, folder: str) -> int:
        """How many processes the kernel killed in `folder` for its limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            with open(os.path.join(folder, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0


class CpuCgroups(Cgroups):
    """CPU-accounting cgroups: nothing limited, only counted (the trainer reads the count while the execution runs
    and kills it at the limit: `colograd.rewards.sandbox_clock`)."""

    CONTROLLER = "cpuacct"

    def _set_up(self, folder: str, limit_bytes: int) -> None:
        if not os.path.exists(os.path.join(folder, "cpuacct.usage" if self.version == 1 else "cpu.stat")):
            raise OSError(f"{folder} counts no CPU time")


def _write(folder: str, name: str, value: int) -> None:
    with open(os.path.join(folder, name), "w") as f:
        f.write(str(value))


def _candidates(controller: str) -> list[tuple[str, int]]:
    """Folders of the trainer's own cgroups that have `controller`: v1's hierarchy of it first, then v2's (for
    memory, only where its controller is enabled for the trainer's children)."""
    try:
        with open("/proc/self/cgroup") as f:
            own = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return []
    found = []
    for _, controllers, path in own:
        version = 2 if controllers == "" else 1 if controller in controllers.split(",") else 0
        for fields in mounts:
            fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
            if (version == 1 and fstype == "cgroup" and controller in options) or (
                version == 2 and fstype == "cgroup2"
            ):
                mount_root, mount_point = fields[3], fields[4]
                relative = path[len(mount_root) :] if path.startswith(mount_root) else path
                folder = os.path.normpath(mount_point + "/" + relative.lstrip("/"))
                if version == 2 and controller == "memory" and not _v2_memory(folder):
                    continue
                found.append((folder, version))
    return sorted(found, key=lambda candidate: candidate[1])


def _v2_memory(folder: str) -> bool:
    """Whether children of a v2 cgroup get the memory controller. (It is not enabled here: that would change the
    machine's cgroups beyond the trainer's own.)"""
    try:
        with open(os.path.join(folder, "cgroup.subtree_control")) as f:
            return "memory" in f.read().split()
    except OSError:
        return False
