"""The sandbox's launcher: run as a script (``python -I -S sandbox_launch.py``), standard library only.

It reads its orders as JSON on stdin, builds the sandbox, runs the program (and, for assert-style tests, the judge
beside it: `colograd.rewards.code_harness`) and reports on the status pipe. Its stdout and stderr become the program's.
Kept apart from `colograd.rewards.sandbox` so that it starts in milliseconds (nothing of colograd, torch or vLLM is
imported) and so that the trainer never forks itself: a process with threads may not enter a new user namespace, and
forking one that holds a vLLM engine copies its state.

Isolated, the processes are (see docs/rewards.md):

    launcher   joins the execution's memory and CPU cgroups (where there are) and a new, empty session keyring;
               new mount, pid, network, IPC and UTS namespaces (and a user namespace when not root), the IPC
               namespace's shared memory limited; builds a new root: a small tmpfs holding read-only binds of the
               system's and the interpreter's folders, /dev/{null,zero,random,urandom}, and a writable tmpfs
               /sandbox; pivots into it
    └─ init    pid 1 of the new pid namespace: dies with the launcher; when it exits, the kernel kills every
       │       process left in the namespace
       ├─ program  no capabilities, no new privileges, rlimits, the seccomp filter; runs the interpreter on
       │           /sandbox/main.py, its stdin the file the trainer gave (stdin/stdout cases) or nothing (asserts)
       └─ judge    (assert-style tests) forked from init, never runs model code: drops every privilege, takes the
                   same limits and filter, runs the tests and reports each one's outcome on the status pipe

In cases mode (`colograd.rewards.sandbox_session.Session`: a completion's stdin/stdout cases, or a checker's), init
runs the program once per case the trainer sends over a Unix socket, each in a fresh /sandbox, and kills whatever a
case left before the next (`serve_cases`).

Unisolated (the explicit opt-in), the launcher is init: it sets the rlimits, and runs the program (and the judge) in
the given folder, with nothing else of the above.
"""

import ctypes
import errno as errnos
import fcntl
import json
import marshal
import os
import platform
import resource
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP = 0x10000000, 0x20000000, 0x40000000, 0x02000000
NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_DUMPABLE = 1, 38, 4
KEYCTL_JOIN_SESSION_KEYRING = 1
F_NOTIFY = 1026  # fcntl's directory notifications (F_LINUX_SPECIFIC_BASE + 2)
# fcntl's file locks and leases: F_GETLK, F_SETLK, F_SETLKW, their open-file-description forms F_OFD_GETLK,
# F_OFD_SETLK, F_OFD_SETLKW, and F_SETLEASE. A lock is the inode's, and every sandbox binds the same system files
# read-only: one taken or tested there is seen by a concurrent sandbox and by the machine (a channel between two
# executions), so none is taken or tested (flock(2), the other kind, is refused whole).
F_LOCKS = (5, 6, 7, 36, 37, 38, 1024)
LOW_32_BITS = 0xFFFFFFFF  # the part of a 64-bit argument register the kernel reads as an int
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "ppc64le": 271, "s390x": 280}
SYSTEM_DIRS = ("usr", "bin", "lib", "lib64", "lib32", "libx32", "sbin")
DEVICES = ("null", "zero", "random", "urandom")
INNER_ID = 1000  # the program's uid and gid inside a user namespace
# As root the program runs under a uid no one uses, one per launcher: RLIMIT_NPROC does not bind uid 0, and a count
# shared by concurrent sandboxes would let one fork bomb starve the others. The judge gets another such uid, so that
# the program can neither signal nor trace it.
ROOT_MODE_UID_BASE = 1 << 24
JUDGE_UID_OFFSET = 1 << 22  # above any pid (pid_max is at most 2^22)
PROGRAM_FDS = (3, 4)  # the program's ends of the judge's channel (`colograd.rewards.code_harness.PROGRAM_FDS`)
JUDGE_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                          "VECLIB_MAXIMUM_THREADS", "BLIS_NUM_THREADS")  # fmt: skip

# What a scored program never needs. Refused with EPERM (clone3 with ENOSYS, so that the C library falls back to
# clone, whose flags a filter can read): tracing and reading other processes, keyrings, BPF, mounts and new
# namespaces, file and device watches, netlink and raw sockets, System V IPC and memory files (outside RLIMIT_AS),
# io_uring and the kernel's AIO (both submit work this filter does not see), directory notifications (fcntl F_NOTIFY:
# inotify's older form), the kernel log and performance counters, modules, reboot, swap, the clock, and changes to
# scheduling: a lower priority, a narrower affinity or the idle class would make the program's first process wait for a
# CPU, a wait the wall clock deducts (`colograd.rewards.sandbox_clock`); and advisory file locks (flock, and fcntl's
# `F_LOCKS`): the system files are the same inodes in every sandbox and on the machine, so a lock on one is a channel
# out of the execution. No scored program needs them, and the C library and Python report the refusal as an error
# (PermissionError) that ends nothing.
REFUSED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd", "syslog",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
    "mount_setattr", "setns", "unshare", "name_to_handle_at", "open_by_handle_at",
    "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark",
    "shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop",
    "semctl", "ipc", "memfd_create", "memfd_secret",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff",
    "acct", "quotactl", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "setpriority", "nice", "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr", "ioprio_set",
    "flock",
)  # fmt: skip
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6: a program may make sockets, which reach nothing

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
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)


def _bind_readonly(source: str, target: str) -> None:
    """Bind `source` at `target`, read-only, no set-uid, no devices."""
    _mount(source, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


# --- protections taken before the namespaces ------------------------------------------------------------------------


def join_cgroup(folder: str) -> bool:
    """Move this process (and so everything it starts) into one of the execution's cgroups, made by the trainer."""
    try:
        _write(os.path.join(folder, "cgroup.procs"), str(os.getpid()))
        return True
    except OSError:
        return False


def new_session_keyring() -> bool:
    """Leave the trainer's session keyring for a new, empty one: keyrings are not namespaced, so a child otherwise
    reads (and adds to) the keys of the session that started the trainer."""
    number = SYS_KEYCTL.get(platform.machine())
    return number is not None and _libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None) >= 0


def limit_ipc(memory_bytes: int) -> bool:
    """Shared memory and message queues of the new IPC namespace (outside RLIMIT_AS) bounded by the memory limit;
    the seccomp filter refuses them too, where there is one."""
    try:
        for name, value in (("shmmax", memory_bytes), ("shmall", max(1, memory_bytes // os.sysconf("SC_PAGE_SIZE"))),
                            ("msgmni", 0)):  # fmt: skip
            _write(f"/proc/sys/kernel/{name}", str(value))
        return True
    except OSError:
        return False


class SeccompFilter:
    """The filter built through libseccomp (ctypes over the system's libseccomp2): loaded here, before the new root
    hides the library, and applied in each child with `apply`."""

    ALLOW, ERRNO = 0x7FFF0000, 0x00050000
    CMP_EQ, CMP_GT, CMP_MASKED_EQ = 4, 6, 7

    class _Cmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]

    def __init__(self) -> None:
        lib = self.lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                               ctypes.POINTER(self._Cmp)]  # fmt: skip
        lib.seccomp_load.argtypes = [ctypes.c_void_p]
        self.ctx = lib.seccomp_init(self.ALLOW)
        if not self.ctx:
            raise OSError("seccomp_init failed")
        for name in REFUSED_SYSCALLS:
            self._refuse(name, errnos.EPERM)
        self._refuse("clone3", errnos.ENOSYS)
        self._refuse("clone", errnos.EPERM, (0, self.CMP_MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
        for flag in (CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP):
            self._refuse("clone", errnos.EPERM, (0, self.CMP_MASKED_EQ, flag, flag))
        # The kernel reads fcntl's command as an unsigned int: only its low 32 bits are compared, or the command with
        # any high bit set would pass the filter and still be F_NOTIFY. (clone reads its flags' low 32 bits too,
        # tested bit by bit above; socket's family is an int, but any high bit makes it greater than the largest
        # family allowed, so the comparison below refuses it.)
        for command in (F_NOTIFY, *F_LOCKS):
            self._refuse("fcntl", errnos.EPERM, (1, self.CMP_MASKED_EQ, LOW_32_BITS, command))
        for family in range(max(SOCKET_FAMILIES)):
            if family not in SOCKET_FAMILIES:
                self._refuse("socket", errnos.EPERM, (0, self.CMP_EQ, family, 0))
        self._refuse("socket", errnos.EPERM, (0, self.CMP_GT, max(SOCKET_FAMILIES), 0))

    def _refuse(self, name: str, errno: int, compare: tuple | None = None) -> None:
        number = self.lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # not a system call of this machine or libseccomp release
            return
        comparisons = (self._Cmp * 1)(self._Cmp(*compare)) if compare else None
        result = self.lib.seccomp_rule_add_array(
            self.ctx, self.ERRNO | errno, number, 1 if compare else 0, comparisons
        )
        if result != 0:
            raise OSError(f"seccomp rule for {name} failed ({result})")

    def apply(self) -> None:
        if self.lib.seccomp_load(self.ctx) != 0:
            raise OSError("seccomp_load failed")


def write_program(orders: dict, folder: str) -> None:
    """The program's files: main.py, for assert-style tests the compiled harness it loads (no test is in it), and
    the files the orders name (a compiled checker: executable)."""
    _write(os.path.join(folder, "main.py"), orders["code"])
    if orders["judge"] is not None:
        with open(os.path.join(folder, "harness.bin"), "wb") as f:
            f.write(bytes.fromhex(orders["judge"]["harness"]))
    for name, data in (orders.get("files") or {}).items():
        path = os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(bytes.fromhex(data))
        os.chmod(path, 0o755)


# --- the namespaces and the new root -------------------------------------------------------------------------------


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
    for name in ("sandbox", "tmp", "dev/shm"):
        os.mkdir(new + "/" + name)
    _mount("tmpfs", new + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, f"size={orders['disk_kib']}k,mode=777")
    # A private /dev/shm for POSIX semaphores and shared memory (multiprocessing's locks and queues): a tmpfs of its
    # own, as small as /sandbox, in no other sandbox's or the machine's view.
    shm = f"size={orders['disk_kib']}k,mode=1777"
    _mount("tmpfs", new + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, shm)
    if owner is not None:
        os.chown(new + "/sandbox", owner, owner)
    write_program(orders, new + "/sandbox")
    os.chdir(new)
    _check(_libc.syscall(SYS_PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detaching the old root")
    os.chdir("/")
    # /tmp is /sandbox: programs that write temporary files find a writable place.
    _mount("/sandbox", "/tmp", None, MS_BIND)
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def enter_namespaces(orders: dict, applied: list[str]) -> int | None:
    """Enter new namespaces and build the root; returns the uid the program takes (root mode), or None."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    wanted = orders["protections"]
    memory = orders["limits"]["AS"]
    if os.geteuid() == 0:
        _unshare(flags, "mount, pid, network, IPC and UTS namespaces")
        if "ipc_limits" in wanted and limit_ipc(memory):
            applied.append("ipc_limits")
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
    if "ipc_limits" in wanted and limit_ipc(memory):
        applied.append("ipc_limits")
    build_root(orders, None)
    return None


# --- the program, the judge and init -------------------------------------------------------------------------------


def set_limits(limits: dict) -> None:
    """The rlimits; soft = hard, so they cannot be raised (CPU: SIGXCPU at the limit, SIGKILL a second later)."""
    for name, value in limits.items():
        hard = value + 1 if name == "CPU" else value
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, hard))


def _keep_fds(wanted: dict[int, int]) -> None:
    """Make `wanted` (target fd -> current fd) the process's only descriptors above stderr."""
    moved = {target: fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for target, fd in wanted.items()}  # clear of the targets
    for target, fd in moved.items():
        os.dup2(fd, target)  # inheritable, so it survives exec
    os.closerange(max(wanted, default=2) + 1, 1 << 16)


def _drop_privileges(uid: int | None) -> None:
    """Root mode: take `uid`, which drops every capability. User namespace: this process (not exec'd) still has the
    namespace's capabilities; clear them."""
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        return

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(ctypes.byref(Header(0x20080522, 0)), data), "dropping capabilities")


def run_program(
    orders: dict, uid: int | None, seccomp: SeccompFilter | None, channel: tuple | None, stdin: int | None = None
) -> None:
    """In the program's process: its descriptors, limits, no privileges, the filter, then the interpreter (or the
    orders' `argv`: a compiled checker). `stdin`: a case's input (cases mode), else the orders' file."""
    if stdin is None:
        stdin = orders["stdin_fd"]
    if orders.get("cases_fd") is not None and not orders["isolated"]:
        os.setpgid(0, 0)  # unisolated, a case's processes are a group of their own, killed as one after it
    os.dup2(stdin if stdin is not None and channel is None else os.open(os.devnull, os.O_RDONLY), 0)
    _keep_fds(dict(zip(PROGRAM_FDS, channel, strict=True)) if channel else {})
    os.chdir(orders["workdir"] or "/sandbox")
    if orders["isolated"] and uid is not None:  # root mode: a uid of its own, which drops every capability
        _drop_privileges(uid)
    set_limits(orders["limits"])
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if seccomp is not None:
        seccomp.apply()
    # UTF-8 mode: stdin and stdout carry any bytes (invalid UTF-8, a lone surrogate's) through as surrogate escapes.
    argv = orders.get("argv") or [orders["python"], "-I", "-X", "utf8", "main.py"]
    os.execve(argv[0], argv, orders["env"])


def run_judge(orders: dict, uid: int | None, seccomp: SeccompFilter | None, channel: tuple, status_fd: int) -> None:
    """In the judge's process (forked, never exec'd: the tests it holds are not in any file): no privileges, the same
    limits and filter, then the harness's `judge`, reporting each test's outcome on the status pipe."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    _keep_fds({3: channel[0], 4: channel[1], 5: status_fd})
    if orders["isolated"]:
        _drop_privileges(None if uid is None else uid + JUDGE_UID_OFFSET)
    set_limits({**orders["limits"], "NPROC": 1, "FSIZE": 0})  # it neither forks nor writes files
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if seccomp is not None:
        seccomp.apply()
    job = orders["judge"]
    sys.path[:] = job["path"]  # the program's interpreter's (its site-packages: a test may import numpy)
    # The judge may not start a thread (NPROC 1): numpy's BLAS and OpenMP pools would fail at import.
    os.environ.update(dict.fromkeys(JUDGE_THREAD_VARIABLES, "1"))

    def report(index: int, outcome: str) -> None:
        os.write(5, (json.dumps({"test": index, "outcome": outcome[:200]}) + "\n").encode())

    try:
        # The harness's modules, in order, each under its own name (a module imports those before it from
        # sys.modules: `colograd.rewards.code_tests.compiled_harness`); the last is the harness itself.
        for name, code in marshal.loads(bytes.fromhex(job["harness"])):
            sys.modules[name] = harness = type(sys)(name)
            exec(code, harness.__dict__)
        harness.judge(job, 3, 4, report)
    except BaseException as err:  # the judge's own failure: the sandbox's, not the program's
        os.write(5, (json.dumps({"judge_error": f"{type(err).__name__}: {err}"[:500]}) + "\n").encode())


def _describe(wait_status: int, usage) -> dict:
    report = {"maxrss_kib": usage.ru_maxrss, "cpu_s": usage.ru_utime + usage.ru_stime}
    if os.WIFSIGNALED(wait_status):
        report["signal"] = os.WTERMSIG(wait_status)
    else:
        report["exit_code"] = os.WEXITSTATUS(wait_status)
    return report


def _stop(program: int, grace_s: float = 0.5) -> dict:
    """The program's status once its judge is done: the judge's end closed the channel, on which the program's
    process exits by itself (flushing what it printed); one that does not within `grace_s` is killed."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        pid, wait_status, usage = os.wait4(program, os.WNOHANG)
        if pid == program:
            return _describe(wait_status, usage)
        time.sleep(0.002)
    os.kill(program, signal.SIGKILL)
    return {**_describe(*os.wait4(program, 0)[1:]), "stopped": True}


def init(orders: dict, uid: int | None, status_fd: int, seccomp: SeccompFilter | None, applied: list[str]) -> None:
    """Say which protections are in force, start the program (and the judge), reap every child until they are done,
    report their status. Isolated, this is pid 1 of the sandbox, and its exit kills whatever the program left behind.
    The protections are reported before the program starts, so that an execution killed from outside (a timeout, the
    CPU or output limit), whose final report never comes, still says what it ran under."""
    if orders["isolated"]:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    os.write(status_fd, (json.dumps({"protections": applied}) + "\n").encode())
    if orders.get("cases_fd") is not None:
        serve_cases(orders, uid, status_fd, seccomp)
        return
    channel = judge_end = None
    if orders["judge"] is not None:
        to_program, to_judge = os.pipe(), os.pipe()
        channel, judge_end = (to_program[0], to_judge[1]), (to_judge[0], to_program[1])
    # The judge first, then the program, before anything else runs in the pid namespace: they are its pids 2 and 3
    # (the program alone: 2), whatever the program forks, and the trainer's clock finds them by these numbers
    # (`colograd.rewards.sandbox_clock.OWN_NAMESPACE_PIDS`).
    judge = None
    if judge_end is not None:
        judge = os.fork()
        if judge == 0:
            try:
                run_judge(orders, uid, seccomp, judge_end, status_fd)
            finally:
                os._exit(0)
    program = os.fork()
    if program == 0:
        try:
            run_program(orders, uid, seccomp, channel)
        finally:
            os._exit(127)
    if judge_end is not None:
        for fd in (*channel, *judge_end):
            os.close(fd)
    status: dict = {"protections": applied}
    while "program" not in status or (judge is not None and "judge" not in status):
        pid, wait_status, usage = os.wait3(0)
        if pid == program:
            status["program"] = _describe(wait_status, usage)
        elif pid == judge:
            status["judge"] = _describe(wait_status, usage)
            if "program" not in status:  # every test has its outcome: the program is no longer needed
                status["program"] = _stop(program)
    os.write(status_fd, (json.dumps(status) + "\n").encode())


def serve_cases(orders: dict, uid: int | None, status_fd: int, seccomp: SeccompFilter | None) -> None:
    """Cases mode: one sandbox, many executions of the program. The trainer sends each case on the control socket as
    it is wanted (a short JSON header naming the files, and their descriptors: the case's stdin first, then each
    file's content), and ends the session by closing the socket. Each case gets a fresh /sandbox (and /tmp,
    /dev/shm) holding the program's files and the case's, a fresh process started as the program always is, and
    when its first process exits, every process left in the sandbox is killed before the next case, so that nothing
    of one case runs in the next; then its status goes on the status pipe: {"case": k, "program": {...}}. The
    program's stdout and stderr are the launcher's, read by the trainer between two such lines."""
    import socket  # only here: the one-execution mode starts without it

    control = socket.socket(fileno=orders["cases_fd"])
    for case in range(1 << 62):
        message, fds, _, _ = socket.recv_fds(control, 1 << 16, 16)
        if not message:
            for fd in fds:
                os.close(fd)
            return  # the trainer ended the session
        names = json.loads(message)["files"]
        if orders["isolated"]:
            fresh_folders(orders, uid)
        else:
            _clear_folder(orders["workdir"])
            write_program(orders, orders["workdir"])
        folder = "/sandbox" if orders["isolated"] else orders["workdir"]
        for name, fd in zip(names, fds[1:], strict=True):
            with os.fdopen(fd, "rb") as source, open(os.path.join(folder, name), "wb") as target:
                while chunk := source.read(1 << 20):
                    target.write(chunk)
            if uid is not None:
                os.chown(os.path.join(folder, name), uid, uid)
        program = os.fork()
        if program == 0:
            try:
                run_program(orders, uid, seccomp, None, fds[0])
            finally:
                os._exit(127)
        os.close(fds[0])
        report = _describe(*os.wait4(program, 0)[1:])
        _end_case(orders, program)
        os.write(status_fd, (json.dumps({"case": case, "program": report}) + "\n").encode())


def fresh_folders(orders: dict, owner: int | None) -> None:
    """A new, empty /sandbox (with the program's files), /tmp and /dev/shm: the last case's are detached, and what
    it wrote is gone with them."""
    for path in ("/tmp", "/sandbox", "/dev/shm"):
        _check(_libc.umount2(path.encode(), MNT_DETACH), f"detaching {path}")
    size = f"size={orders['disk_kib']}k"
    _mount("tmpfs", "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, f"{size},mode=777")
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"{size},mode=1777")
    if owner is not None:
        os.chown("/sandbox", owner, owner)
    write_program(orders, "/sandbox")
    if owner is not None:
        for name in os.listdir("/sandbox"):
            os.chown(os.path.join("/sandbox", name), owner, owner)
    _mount("/sandbox", "/tmp", None, MS_BIND)


def _clear_folder(folder: str) -> None:
    import shutil

    for entry in os.scandir(folder):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)


def _end_case(orders: dict, program: int) -> None:
    """Kill what the case left running and reap it. Isolated, this is the sandbox's pid 1: every other process in
    its pid namespace; unisolated, the case's process group."""
    try:
        if orders["isolated"]:
            os.kill(-1, signal.SIGKILL)  # from pid 1: every process of the namespace but itself
        else:
            os.killpg(program, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def main() -> None:
    orders = json.loads(sys.stdin.buffer.read())
    status_fd = orders["status_fd"]
    applied: list[str] = []
    if not orders["isolated"]:
        write_program(orders, orders["workdir"])
        init(orders, None, status_fd, None, applied)
        return
    wanted = orders["protections"]
    try:
        for name, folder in orders["cgroups"].items():  # the memory cgroup, the CPU-accounting one
            if name in wanted and join_cgroup(folder):
                applied.append(name)
        if "session_keyring" in wanted and new_session_keyring():
            applied.append("session_keyring")
        seccomp = None
        if "seccomp" in wanted:
            try:
                seccomp = SeccompFilter()
                applied.append("seccomp")
            except OSError:
                seccomp = None
        uid = enter_namespaces(orders, applied)
    except (SetupError, OSError) as err:
        os.write(status_fd, json.dumps({"setup_error": str(err)}).encode())
        os._exit(0)
    child = os.fork()  # the first child of a new pid namespace is its pid 1
    if child == 0:
        try:
            init(orders, uid, status_fd, seccomp, applied)
        finally:
            os._exit(0)
    os.close(status_fd)
    if orders.get("cases_fd") is not None:
        os.close(orders["cases_fd"])
    os.waitpid(child, 0)


if __name__ == "__main__":
    main()
