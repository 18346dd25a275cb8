"""The sandbox's launcher: run as a script (``python -I -S sandbox_launch.py``), standard library only.

It reads its orders as JSON on stdin, builds the sandbox, runs the program and reports on the status pipe. Its
stdout and stderr become the program's. Kept apart from `colograd.sandbox` so that it starts in milliseconds
(nothing of colograd, torch or vLLM is imported) and so that the trainer never forks itself: a process with
threads may not enter a new user namespace, and forking one that holds a vLLM engine copies its state.

Isolated, the processes are (see docs/rewards.md):

    launcher   new mount, pid, network, IPC and UTS namespaces (and a user namespace when not root);
               builds a new root: a small tmpfs holding read-only binds of the system's and the interpreter's
               folders, /dev/{null,zero,random,urandom}, and a writable tmpfs /sandbox; pivots into it
    └─ init    pid 1 of the new pid namespace: dies with the launcher; when it exits, the kernel kills every
       │       process left in the namespace
       └─ program  no capabilities, no new privileges, rlimits; runs the interpreter on /sandbox/main.py

Unisolated (the explicit opt-in), the launcher sets the rlimits, moves into the given folder and becomes the program.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_DUMPABLE = 1, 38, 4
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
SYSTEM_DIRS = ("usr", "bin", "lib", "lib64", "lib32", "libx32", "sbin")
DEVICES = ("null", "zero", "random", "urandom")
INNER_ID = 1000  # the program's uid and gid inside a user namespace
# As root the program runs under a uid no one uses, one per launcher: RLIMIT_NPROC does not bind uid 0, and a count
# shared by concurrent sandboxes would let one fork bomb starve the others.
ROOT_MODE_UID_BASE = 1 << 24

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The sandbox could not be built; the message names the step and what the kernel said."""


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what} failed: {os.strerror(errno)} (errno {errno})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _unshare(flags: int, what: str) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), f"unshare({what})")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _bind_readonly(source: str, target: str) -> None:
    """Bind `source` at `target`, read-only, no set-uid, no devices."""
    _mount(source, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(orders: dict, owner: int | None) -> None:
    """Make a new root from a tmpfs and pivot into it; the old root is detached, so nothing else of the machine's
    files is reachable. `owner`: the uid that gets /sandbox (root mode), else it is world-writable."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates back to the machine
    new = "/tmp"  # any folder serves as the mount point: the mount is private to this namespace
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for name in SYSTEM_DIRS:
        path = "/" + name
        if os.path.islink(path):
            os.symlink(os.readlink(path), new + path)
        elif os.path.isdir(path):
            os.mkdir(new + path)
            _bind_readonly(path, new + path)
    for path in orders["binds"]:  # the interpreter's prefix, at its own path (its compiled-in paths stay valid)
        target = new + path
        if not os.path.exists(target):
            os.makedirs(target)
            _bind_readonly(path, target)
    os.mkdir(new + "/dev")
    for name in DEVICES:
        _write(f"{new}/dev/{name}", "")
        _mount(f"/dev/{name}", f"{new}/dev/{name}", None, MS_BIND)
    for name in ("sandbox", "tmp"):
        os.mkdir(new + "/" + name)
    _mount("tmpfs", new + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, f"size={orders['disk_kib']}k,mode=777")
    if owner is not None:
        os.chown(new + "/sandbox", owner, owner)
    _write(new + "/input", orders["stdin"])
    _write(new + "/sandbox/main.py", orders["code"])
    os.chdir(new)
    _check(_libc.syscall(SYS_PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detaching the old root")
    os.chdir("/")
    # /tmp is /sandbox: programs that write temporary files find a writable place.
    _mount("/sandbox", "/tmp", None, MS_BIND)
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def enter_namespaces(orders: dict) -> int | None:
    """Enter new namespaces and build the root; returns the uid the program takes (root mode), or None."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if os.geteuid() == 0:
        _unshare(flags, "mount, pid, network, IPC and UTS namespaces")
        uid = ROOT_MODE_UID_BASE + os.getpid()
        build_root(orders, uid)
        return uid
    uid, gid = os.geteuid(), os.getegid()
    _unshare(flags | CLONE_NEWUSER, "user, mount, pid, network, IPC and UTS namespaces")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{INNER_ID} {uid} 1")
    _write("/proc/self/gid_map", f"{INNER_ID} {gid} 1")
    os.setresgid(INNER_ID, INNER_ID, INNER_ID)
    os.setresuid(INNER_ID, INNER_ID, INNER_ID)  # keeps this process's capabilities in its namespace until exec
    build_root(orders, None)
    return None


def set_limits(limits: dict) -> None:
    """The program's rlimits; soft = hard, so it cannot raise them (CPU: SIGXCPU at the limit, SIGKILL a second
    later)."""
    for name, value in limits.items():
        hard = value + 1 if name == "CPU" else value
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, hard))


def run_program(orders: dict, uid: int | None) -> None:
    """In the program's process: stdin from the input, limits, no privileges, then the interpreter."""
    fd = os.open("/input", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    os.chdir("/sandbox")
    if uid is not None:  # root mode: a uid of its own, which drops every capability
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    set_limits(orders["limits"])
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.closerange(3, 1 << 16)
    os.execve(orders["python"], [orders["python"], "-I", "main.py"], orders["env"])


def init(orders: dict, uid: int | None, status_fd: int) -> None:
    """pid 1 of the sandbox: start the program, reap every child until the program exits, report
    its status; exiting then kills whatever it left behind."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    program = os.fork()
    if program == 0:
        try:
            run_program(orders, uid)
        finally:
            os._exit(127)
    while True:
        pid, wait_status, usage = os.wait3(0)
        if pid == program:
            break
    report = {"maxrss_kib": usage.ru_maxrss, "cpu_s": usage.ru_utime + usage.ru_stime}
    if os.WIFSIGNALED(wait_status):
        report["signal"] = os.WTERMSIG(wait_status)
    else:
        report["exit_code"] = os.WEXITSTATUS(wait_status)
    os.write(status_fd, json.dumps(report).encode())
    os._exit(0)


def main() -> None:
    orders = json.loads(sys.stdin.buffer.read())
    status_fd = orders["status_fd"]
    if not orders["isolated"]:
        os.close(status_fd)  # the trainer reads the program's own exit status
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.chdir(orders["workdir"])
        with open("input", "w") as f:
            f.write(orders["stdin"])
        with open("main.py", "w") as f:
            f.write(orders["code"])
        fd = os.open("input", os.O_RDONLY)
        os.dup2(fd, 0)
        set_limits(orders["limits"])
        os.execve(orders["python"], [orders["python"], "-I", "main.py"], orders["env"])
    try:
        uid = enter_namespaces(orders)
    except (SetupError, OSError) as err:
        os.write(status_fd, json.dumps({"setup_error": str(err)}).encode())
        os._exit(0)
    child = os.fork()  # the first child of a new pid namespace is its pid 1
    if child == 0:
        try:
            init(orders, uid, status_fd)
        finally:
            os._exit(127)
    os.close(status_fd)
    os.waitpid(child, 0)


if __name__ == "__main__":
    main()
