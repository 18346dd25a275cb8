"""The sandbox against attacker-shaped programs: each is contained, killed, given a failure reason, and nothing
outside the sandbox changes. Each runs twice: as a program (stdin/stdout tests run it so), and as the solution of an
assert-style row, inside the harness that runs its tests (`colograd.rewards.code_tests`), its outcome read back from
the
harness's report.

``COLOGRAD_TEST_SANDBOX=none`` runs these same tests with the isolation removed (the `code_sandbox: none` opt-in):
those that test the namespaces must then fail (docs/rewards.md lists which do). The opt-in keeps the rlimits and
the wall-time and output caps, so the tests of those pass either way. The fork test's program is bounded (200 forks),
so that the machine survives it unisolated.
"""

import concurrent.futures
import ctypes
import dataclasses
import errno
import functools
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from colograd.errors import ConfigError
from colograd.rewards.code import CodeReward
from colograd.rewards.code_tests import AssertTests, run_asserts
from colograd.rewards.sandbox import PROTECTIONS, Execution, Sandbox, SandboxLimits, SandboxUnavailable
from colograd.rewards.sandbox_clock import POLL_S, Clock, ProcTreeCpu

ISOLATED = os.environ.get("COLOGRAD_TEST_SANDBOX", "namespaces") != "none"
LIMITS = SandboxLimits(wall_s=1.5, cpu_s=1, memory_mib=256, processes=16, output_kib=64, file_mib=4)
# How long an execution that sleeps or is killed for a limit may last here: its wall limit, the sandbox's setup and
# teardown, and the waits for a CPU its clock does not charge it (up to the backstop, BACKSTOP x the wall limit), so
# that the verdict does not depend on the machine's load (3 x the wall limit, 4.5 s, failed a fork bomb killed in 5.2 s
# at a load of 9 on 2 cores); under the 30 s the children of one test sleep, which must die with their program.
LONGEST_S = 25.0


class AsSolution:
    """The sandbox as assert-style tests use it: the program is a row's solution, followed by one test that always
    passes, so that the harness's report for it is the program's own outcome."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def run(self, code: str) -> Execution:
        result = run_asserts(self.sandbox, AssertTests("", "", ("assert True",)), code)
        return dataclasses.replace(result.execution, reason=result.failures[0])


class AsCase:
    """The sandbox as stdin/stdout cases use it: the program is a case of a session (`Sandbox.session`; what one case
    leaves for the next is tests/rewards/test_code_cases.py's)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def run(self, code: str, stdin: str = "") -> Execution:
        with self.sandbox.session(code) as session:
            return session.case(stdin)


@pytest.fixture(scope="module", params=["program", "assert-style solution", "case of a session"])
def sandbox(request) -> Sandbox | AsSolution | AsCase:
    sandbox = Sandbox(LIMITS, isolated=ISOLATED)
    return {"program": sandbox, "assert-style solution": AsSolution(sandbox), "case of a session": AsCase(sandbox)}[
        request.param
    ]


def leftovers(marker: str) -> list[int]:
    """Pids of processes on this machine whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(entry))
    return found


def test_a_plain_program_runs(sandbox):
    run = sandbox.run("a, b = 3, 4\nprint(a + b)")
    assert run.ok and run.stdout == "7\n" and run.exit_code == 0


def test_a_tight_wall_limit_is_not_taken_for_a_sandbox_that_cannot_start():
    """The start-up probe (one trivial program) runs under limits of its own: with the run's limit of a millisecond
    it was cut short, and the sandbox refused to start as if the machine lacked namespaces (seen under load with a
    second's limit). The runs themselves keep theirs."""
    sandbox = Sandbox(SandboxLimits(wall_s=0.001, cpu_s=1), isolated=ISOLATED)
    assert sandbox.limits.wall_s == 0.001
    assert sandbox.run("import time\ntime.sleep(1)").reason == "timeout"


def test_the_environment_and_its_credentials_are_not_seen(sandbox, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_colograd_test_secret")
    run = sandbox.run("import os; print(dict(os.environ))")
    assert run.ok and "hf_colograd_test_secret" not in run.stdout


def test_the_home_folder_and_hub_cache_are_not_seen(sandbox, tmp_path, monkeypatch):
    # A file of the trainer's user (home and hub cache live at the same kind of path).
    secret = tmp_path / "cache" / "huggingface" / "token"
    secret.parent.mkdir(parents=True)
    secret.write_text("hf_colograd_test_secret")
    code = (
        "import os\n"
        f"for path in [{str(secret)!r}, os.path.expanduser('~/.cache/huggingface/token'), '/root/.bashrc']:\n"
        "    try:\n"
        "        print(open(path).read())\n"
        "    except OSError as err:\n"
        "        print('refused', type(err).__name__)\n"
        f"print(os.path.exists({str(tmp_path)!r}), os.path.exists('/work'), os.path.exists('/home'))\n"
    )
    run = sandbox.run(code)
    assert run.ok and "hf_colograd_test_secret" not in run.stdout
    assert run.stdout.splitlines()[-1] == "False False False"


def test_writes_into_the_output_dir_and_outside_its_folder_change_nothing(sandbox, tmp_path):
    output_dir = tmp_path / "output_dir"
    output_dir.mkdir()
    outside = Path("/tmp") / f"colograd-test-{uuid.uuid4().hex}"
    code = (
        f"for path in [{str(output_dir / 'model.safetensors')!r}, {str(outside)!r}, '/usr/colograd-test']:\n"
        "    open(path, 'w').write('pwned')\n"
    )
    run = sandbox.run(code)
    assert not run.ok and run.reason.startswith("error: ")
    assert list(output_dir.iterdir()) == [] and not outside.exists()
    if outside.exists():  # unisolated: clean up what it wrote
        outside.unlink()


def test_its_own_folder_is_writable_and_thrown_away(sandbox):
    run = sandbox.run("import os; open('scratch', 'w').write('x'); print(os.getcwd(), os.listdir('.'))")
    assert run.ok
    again = sandbox.run("import os; print(os.listdir('.'))")
    assert "scratch" not in again.stdout


def test_no_socket_reaches_the_machine_not_even_loopback(sandbox):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'hi')"
        run = sandbox.run(code)
        with pytest.raises(TimeoutError):
            server.accept()
    assert not run.ok and run.reason.startswith("error: ")


def test_forks_are_bounded(sandbox):
    code = (
        "import os, time\n"
        "made = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        made += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print(made)\n"
    )
    start = time.monotonic()
    run = sandbox.run(code)
    assert time.monotonic() - start < LONGEST_S  # not the children's 30 s: they die with the program
    assert int(run.stdout or 0) < LIMITS.processes


def test_a_fork_bomb_is_contained_and_killed(sandbox):
    if not ISOLATED:
        pytest.skip("an unbounded fork bomb is only run inside the sandbox (unisolated it would take the machine)")
    start = time.monotonic()
    run = sandbox.run("import os\nwhile True:\n    os.fork()")
    assert not run.ok and time.monotonic() - start < LONGEST_S


def test_endless_allocation_fails_as_memory(sandbox):
    run = sandbox.run("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))")
    assert run.reason == "memory"


def test_open_files_are_bounded(sandbox):
    code = (
        "import os\nfds = []\ntry:\n    while len(fds) < 1000:\n        fds.append(os.open('/dev/null', 0))\n"
        "except OSError as err:\n    print(err.errno, len(fds))\n"
    )
    refused, opened = map(int, sandbox.run(code).stdout.split())
    assert refused == errno.EMFILE and opened < LIMITS.open_files


@pytest.mark.skipif(not ISOLATED, reason="the folders and their sizes are the isolated sandbox's")
@pytest.mark.parametrize("folder", ["/sandbox", "/dev/shm"])
def test_the_folders_it_may_write_are_bounded_in_size(folder):
    # Files each under the file size limit (4 MiB), together past the folder's size (disk_mib, 16 MiB): the write
    # that fills the folder is refused.
    code = (
        "import errno\nwritten = 0\ntry:\n    for i in range(16):\n"
        f"        with open('{folder}/f%d' % i, 'wb') as f:\n            f.write(b'x' * (3 << 20))\n"
        "        written += 3\nexcept OSError as err:\n    print(errno.errorcode[err.errno], written)\n"
    )
    run = Sandbox(LIMITS).run(code)
    assert run.stdout.split()[:1] == ["ENOSPC"], run  # without a size, all 48 MiB are written
    assert int(run.stdout.split()[1]) <= LIMITS.disk_mib


def test_endless_printing_is_cut_at_the_output_cap(sandbox):
    run = sandbox.run("while True:\n    print('x' * 1000)")
    assert run.reason == "output limit" and len(run.stdout) <= LIMITS.output_kib * 1024


def test_sleeping_forever_is_killed_at_the_wall_time(sandbox):
    start = time.monotonic()
    run = sandbox.run("import time; time.sleep(1000)")
    assert run.reason == "timeout" and LIMITS.wall_s <= time.monotonic() - start < LONGEST_S


def test_spinning_is_killed_at_the_cpu_limit(sandbox):
    run = sandbox.run("while True:\n    pass")
    assert run.reason in ("cpu time", "timeout")


def test_signals_reach_neither_its_parent_nor_the_trainer(sandbox):
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        code = (
            "import os, signal\n"
            "for pid in (os.getppid(), " + str(os.getpid()) + "):\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGUSR1)\n"
            "    except OSError as err:\n"
            "        print('refused', pid, type(err).__name__)\n"
        )
        run = sandbox.run(code)
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == [] and run.stdout.count("refused") == 2


def test_children_left_behind_are_killed(sandbox):
    marker = f"{time.time_ns() % 10**6}.25"  # sleep's argument, to find the child by its command line
    code = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"  # out of the process group too
        f"    os.execv('/bin/sleep', ['sleep', {marker!r}])\n"
        "print('parent exits')\n"
    )
    run = sandbox.run(code)
    deadline = time.monotonic() + 2
    while leftovers(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = leftovers(marker)
    for pid in alive:  # unisolated: clean up
        os.kill(pid, signal.SIGKILL)
    assert run.ok and alive == []


def test_the_trainers_processes_are_not_seen(sandbox):
    code = (
        "import os\n"
        "try:\n"
        f"    print(open('/proc/{os.getpid()}/environ', 'rb').read()[:50])\n"
        "except OSError as err:\n"
        "    print('refused', type(err).__name__)\n"
        "print(os.path.exists('/proc/1/cmdline'))\n"
    )
    run = sandbox.run(code)
    assert run.stdout.splitlines() == ["refused FileNotFoundError", "False"]


def test_shared_memory_of_the_machine_is_not_reached(sandbox):
    # The sandbox's /dev/shm is a tmpfs of its own (multiprocessing's semaphores live there): what the machine's
    # holds is not seen, and what the program writes there does not reach it.
    machine = Path("/dev/shm") / f"colograd-test-{uuid.uuid4().hex}"
    machine.write_text("the machine's")
    name = f"colograd-test-{uuid.uuid4().hex}"
    try:
        run = sandbox.run(
            f"import os\nprint(os.path.exists({str(machine)!r}))\nopen('/dev/shm/{name}', 'w').write('x')"
        )
    finally:
        machine.unlink()
    written = Path("/dev/shm") / name
    exists = written.exists()
    if exists:
        written.unlink()
    assert "False" in run.stdout and "True" not in run.stdout and not exists


def test_posix_message_queues_are_the_sandboxs_own(sandbox):
    # The filter leaves mq_open to programs. POSIX message queues belong to an IPC namespace, and the sandbox's is new:
    # the machine's queues are not seen, and the program's go with its namespace.
    libc = ctypes.CDLL(None, use_errno=True)
    machine, left = (f"/colograd-test-{uuid.uuid4().hex}".encode() for _ in range(2))
    create = os.O_RDWR | os.O_CREAT
    queue = libc.mq_open(machine, create, 0o600, None)
    assert queue >= 0, ctypes.get_errno()
    try:
        run = sandbox.run(
            f"import ctypes, os\nlibc = ctypes.CDLL(None)\nprint(libc.mq_open({machine!r}, os.O_RDWR) >= 0, "
            f"libc.mq_open({left!r}, {create}, 0o600, None) >= 0)"
        )
    finally:
        libc.mq_close(queue)
        libc.mq_unlink(machine)
    found = libc.mq_open(left, os.O_RDWR)
    if found >= 0:
        libc.mq_close(found)
        libc.mq_unlink(left)
    assert run.stdout.split() == ["False", "True"] and found < 0, run


def test_a_large_file_is_stopped_at_the_file_size_limit(sandbox):
    run = sandbox.run("open('big', 'wb').write(b'x' * (64 << 20))")
    assert run.reason == "file size"


def test_where_the_sandbox_cannot_be_built_it_refuses_in_one_line(tmp_path, monkeypatch):
    # A launcher that reports what the real one reports where the kernel refuses a namespace (this machine grants
    # them, so the refusal itself is stood in for): the reward must not start, and must say why in one line.
    refusing = tmp_path / "launch.py"
    refusing.write_text(
        "import json, os, sys\n"
        "fd = json.loads(sys.stdin.read())['status_fd']\n"
        "os.write(fd, json.dumps({'setup_error': 'unshare(user, mount, pid, network, IPC and UTS namespaces) failed: "
        "Operation not permitted (errno 1)'}).encode())\n"
    )
    monkeypatch.setattr("colograd.rewards.sandbox.LAUNCHER", str(refusing))
    with pytest.raises(SandboxUnavailable) as err:
        Sandbox(LIMITS)
    message = str(err.value)
    assert "\n" not in message and "Operation not permitted" in message and "code_sandbox: none" in message
    with pytest.raises(ConfigError, match="no Python interpreter at /nonexistent"):
        Sandbox(LIMITS, python="/nonexistent/bin/python3")


@pytest.mark.skipif(
    not (ISOLATED and os.geteuid() == 0 and os.path.exists("/usr/bin/python3")),
    reason="needs root (to become an unprivileged user) and a system interpreter an unprivileged user can read",
)
def test_an_unprivileged_trainer_gets_the_same_isolation_through_a_user_namespace(monkeypatch, tmp_path):
    # The launcher run as `nobody` takes the user-namespace path; the program is then uid 1000 inside.
    monkeypatch.setattr(subprocess, "Popen", functools.partial(subprocess.Popen, user=65534, group=65534))
    sandbox = Sandbox(LIMITS, python="/usr/bin/python3")
    monkeypatch.setenv("HF_TOKEN", "hf_colograd_test_secret")
    code = (
        "import os, socket\n"
        "print(os.getuid(), sorted(os.listdir('/')), 'HF_TOKEN' in os.environ)\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', 22), timeout=1)\n"
        "except OSError as err:\n"
        "    print('refused', type(err).__name__)\n"
    )
    run = sandbox.run(code)
    assert run.ok, run.stderr
    assert run.stdout.splitlines() == [
        "1000 ['bin', 'dev', 'lib', 'lib64', 'sandbox', 'sbin', 'tmp', 'usr'] False",
        "refused OSError",
    ]
    # A fork bomb ends by itself, its forks refused: the program fails, neither timed out nor killed. Which of its
    # processes' tracebacks ends the shared stderr varies (interleaved), so the reason is "error: BlockingIOError"
    # or "exit code 1" (an interleaved last line).
    bomb = sandbox.run("import os\nwhile True:\n    os.fork()")
    assert not bomb.ok and bomb.reason.startswith(("error: ", "exit code ")), bomb.reason
    # The judge of assert-style tests runs there too (its namespace capabilities cleared), and decides as it does
    # as root; a program that kills it (they share the namespace's one uid) fails its tests.
    tests = AssertTests("", "", ("assert add(1, 2) == 3", "assert add(0, 5) == 5"))
    assert run_asserts(sandbox, tests, "def add(a, b):\n    return a + b\n").failures == [None, None]
    equal = "class E:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return E()\n"
    assert run_asserts(sandbox, tests, equal).failures == ["not plain data: E"] * 2
    killer = (
        "import os\nfor pid in set(range(1, 64)) - {os.getpid()}:\n    try:\n        os.kill(pid, 9)\n"
        "    except OSError:\n        pass\ndef add(a, b):\n    return 0\n"
    )
    assert None not in run_asserts(sandbox, tests, killer).failures


# --- the protections beyond the namespaces, each shown to hold by removing it ----------------------------------------
# Each case runs an attack with every protection but the one(s) under test removed, and with none: with none it must
# escape (so the test can see an escape), with each of its protections it must not.

needs_isolation = pytest.mark.skipif(not ISOLATED, reason="the protections are the isolated sandbox's")
MEMORY = SandboxLimits(wall_s=10.0, cpu_s=5, memory_mib=128, processes=16, file_mib=16)
HELD_MIB = 512  # what each attack tries to hold: 4x memory_mib, well past the whole execution's cgroup limit

MEMORY_ATTACKS = {
    # Processes each under RLIMIT_AS, together over it.
    "processes": f"""
import os, time
children = []
for _ in range(8):
    pid = os.fork()
    if pid == 0:
        block = b"x" * ({HELD_MIB // 8} << 20)
        time.sleep(1)
        os._exit(0)
    children.append(pid)
if all(os.waitpid(pid, 0)[1] == 0 for pid in children):
    print("held", {HELD_MIB})
""",
    # System V shared memory: segments stay after they are detached, outside RLIMIT_AS.
    "shared memory": f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held = 0
for _ in range(8):
    shm = libc.shmget(0, {HELD_MIB // 8} << 20, 0o1600)
    address = libc.shmat(shm, None, 0) if shm >= 0 else None
    if not address or address == ctypes.c_void_p(-1).value:
        break
    ctypes.memset(address, 1, {HELD_MIB // 8} << 20)
    libc.shmdt(ctypes.c_void_p(address))
    held += {HELD_MIB // 8}
if held == {HELD_MIB}:
    print("held", held)
""",
    # Memory files written, not mapped: their pages are outside RLIMIT_AS; each under RLIMIT_FSIZE.
    "memory files": f"""
import os
chunk = b"x" * (1 << 20)
files = [os.memfd_create("x") for _ in range({HELD_MIB // 16})]
for fd in files:
    for _ in range(16):
        os.write(fd, chunk)
print("held", {HELD_MIB})
""",
}
MEMORY_GUARDS = {"processes": ("memory_cgroup",), "shared memory": ("memory_cgroup", "seccomp", "ipc_limits"),
                 "memory files": ("memory_cgroup", "seccomp")}  # fmt: skip


@needs_isolation
@pytest.mark.parametrize("attack", MEMORY_ATTACKS)
def test_memory_is_bounded_for_everything_a_program_allocates(attack):
    code = MEMORY_ATTACKS[attack]
    unprotected = Sandbox(MEMORY, protections=())
    assert f"held {HELD_MIB}" in unprotected.run(code).stdout  # without its guards, the attack holds 4x the limit
    for guard in MEMORY_GUARDS[attack]:
        sandbox = Sandbox(MEMORY, protections=(guard,))
        if guard not in sandbox.protections:
            pytest.skip(f"{guard} is not available on this machine")
        run = sandbox.run(code)
        assert "held" not in run.stdout, (guard, run)
        if guard == "memory_cgroup" and attack == "memory files":  # the kernel's kill, reported as the limit's
            assert run.reason == "memory", run


KEY_TYPE, SESSION_KEYRING = b"user", -3
KEYCTL_SEARCH, KEYCTL_READ, KEYCTL_INVALIDATE = 10, 11, 21


def _keyctl(*args) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(250, *args)


@needs_isolation
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the keyctl system call's number is x86-64's here")
def test_the_trainers_keyrings_are_neither_read_nor_written():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    secret, name = f"token-{uuid.uuid4().hex}".encode(), f"colograd-test-{uuid.uuid4().hex}".encode()
    key = libc.syscall(248, KEY_TYPE, name, secret, len(secret), SESSION_KEYRING)  # add_key to this session's keyring
    if key < 0:
        pytest.skip(f"this process may not use keyrings (errno {ctypes.get_errno()})")
    code = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
key = libc.syscall(250, {KEYCTL_SEARCH}, {SESSION_KEYRING}, b"user", {name!r}, 0)
buffer = ctypes.create_string_buffer(256)
size = libc.syscall(250, {KEYCTL_READ}, key, buffer, 256) if key >= 0 else -1
print("read", buffer.raw[:max(size, 0)].decode())
left = libc.syscall(248, b"user", {name + b"-left"!r}, b"x", 1, {SESSION_KEYRING})
print("left", left >= 0)
"""

    def left_behind() -> bool:
        found = libc.syscall(250, KEYCTL_SEARCH, SESSION_KEYRING, KEY_TYPE, name + b"-left", 0)
        if found >= 0:
            libc.syscall(250, KEYCTL_INVALIDATE, found)
        return found >= 0

    try:
        run = Sandbox(LIMITS, protections=()).run(code)
        assert secret.decode() in run.stdout and left_behind()  # without its guards, it reads and writes them
        for guard in ("session_keyring", "seccomp"):
            run = Sandbox(LIMITS, protections=(guard,)).run(code)
            assert run.ok and secret.decode() not in run.stdout and not left_behind(), (guard, run)
    finally:
        libc.syscall(250, KEYCTL_INVALIDATE, key)


SYSCALL_ATTACKS = {
    "ptrace": "libc.ptrace(0, 0, 0, 0) == 0",  # PTRACE_TRACEME
    "inotify": "libc.inotify_init1(0) >= 0",
    "netlink": "libc.socket(16, 3, 15) >= 0",  # AF_NETLINK, SOCK_RAW, NETLINK_KOBJECT_UEVENT: the host's devices
    "new user namespace": "libc.unshare(0x10000000) == 0",
    "keyring": "libc.syscall(250, 0, -3, 1) >= 0",  # KEYCTL_GET_KEYRING_ID
    "bpf": "libc.syscall(321, 0, 0, 0) != -1 or ctypes.get_errno() != 1",
    "aio": "libc.syscall(206, 8, ctypes.byref(ctypes.c_ulong(0))) == 0",  # io_setup
    "dnotify": "libc.fcntl(__import__('os').open('/sandbox', 0), 1026, 1) == 0",  # F_NOTIFY, DN_ACCESS
    # The same with a high bit set in the 64-bit register: the kernel reads the command's low 32 bits, F_NOTIFY.
    "dnotify, high bits": "libc.syscall(*map(ctypes.c_long, (72, __import__('os').open('/sandbox', 0), 1 << 32 | 1026,"
    " 1))) == 0",
    "message queue": "libc.msgget(0, 0o1600) >= 0",  # IPC_PRIVATE, IPC_CREAT | 0600
    "semaphore": "libc.semget(0, 1, 0o1600) >= 0",
    "io_uring": "libc.syscall(425, 8, ctypes.byref((ctypes.c_char * 120)())) >= 0",  # io_uring_setup
    # Scheduling changes, which would make the program's first process wait for a CPU, a wait the wall clock deducts.
    # Each tried with the value it already has, so that the run without the filter is not slowed by them; the filter
    # refuses the call whatever it asks.
    "renice": "libc.setpriority(0, 0, libc.getpriority(0, 0)) == 0",  # PRIO_PROCESS, this process (nice(2) is it)
    "affinity": "libc.sched_getaffinity(0, 128, m := ctypes.create_string_buffer(128)) == 0"
    " and libc.sched_setaffinity(0, 128, m) == 0",
    "scheduler": "libc.sched_setscheduler(0, 0, ctypes.byref(ctypes.c_int(0))) == 0",  # SCHED_OTHER
    "scheduler parameters": "libc.sched_setparam(0, ctypes.byref(ctypes.c_int(0))) == 0",
    # sched_setattr: SCHED_OTHER at the nice value the process has (sched_attr's fifth 32-bit field)
    "scheduler attributes": "libc.syscall(314, 0, (ctypes.c_uint32 * 12)(48, 0, 0, 0, libc.getpriority(0, 0)), 0)"
    " == 0",
    "io priority": "libc.syscall(251, 1, 0, 0) == 0",  # ioprio_set, IOPRIO_WHO_PROCESS, this process, the default
}
# The attacks that succeed without the filter on any machine the sandbox runs on (bpf and io_uring may be refused by
# the kernel itself: they are tried, but not required to succeed unfiltered).
SYSCALL_ESCAPES = {"ptrace", "inotify", "netlink", "new user namespace", "keyring", "aio", "dnotify",
                   "dnotify, high bits", "message queue", "semaphore", "renice", "affinity", "scheduler",
                   "scheduler parameters", "scheduler attributes", "io priority"}  # fmt: skip


@needs_isolation
def test_the_seccomp_filter_refuses_what_a_scored_program_never_needs():
    code = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n" + "".join(
        f"print({name!r}, {test})\n" for name, test in SYSCALL_ATTACKS.items()
    )
    unfiltered = Sandbox(LIMITS, protections=()).run(code)
    assert unfiltered.ok, unfiltered.stderr
    allowed = [line.rpartition(" ")[0].strip("'") for line in unfiltered.stdout.splitlines() if line.endswith("True")]
    assert SYSCALL_ESCAPES <= set(allowed)
    filtered = Sandbox(LIMITS, protections=("seccomp",))
    if "seccomp" not in filtered.protections:
        pytest.skip("libseccomp2 is not installed here")
    run = filtered.run(code)
    assert run.ok and "True" not in run.stdout, run.stdout
    # What programs do use still works: threads, processes, pipes, loopback sockets of their own.
    common = (
        "import os, socket, subprocess, threading\n"
        "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
        "print(subprocess.run(['/bin/echo', 'process'], capture_output=True, text=True).stdout.strip())\n"
        "a, b = socket.socketpair(); a.send(b'pair'); print(b.recv(4).decode())\n"
        "r, w = os.pipe(); os.write(w, b'pipe'); print(os.read(r, 4).decode())\n"
    )
    assert filtered.run(common).stdout.split() == ["thread", "process", "pair", "pipe"]


# Advisory locks on a file every sandbox binds read-only (the interpreter): the host holds an exclusive flock and an
# fcntl read lock on it while the program probes them. Seen, they are a channel between executions (a concurrent
# sandbox holds or drops a lock; issue 62).
LOCK_PROBES = {
    "flock": "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)",
    "posix lock": "fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)",
    "posix test": "struct.unpack('hh', fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack('hhqqi', fcntl.F_WRLCK, 0, 0, 0,"
    " 0))[:4])[0] != fcntl.F_UNLCK and see()",
    "ofd lock": "fcntl.fcntl(fd, 37, struct.pack('hhqqi', fcntl.F_RDLCK, 0, 0, 0, 0))",  # F_OFD_SETLK
}


@needs_isolation
def test_advisory_locks_are_no_channel_out_of_the_sandbox():
    sandbox = Sandbox(LIMITS)
    code = (
        f"import fcntl, os, struct, sys\nfd = os.open({sandbox.python!r}, os.O_RDONLY)\n"
        "def see():\n    raise BlockingIOError\n"
        + "".join(
            f"try:\n    {probe}\n    print({name!r}, 'free')\nexcept BlockingIOError:\n    print({name!r}, 'seen')\n"
            f"except PermissionError:\n    print({name!r}, 'refused')\n"
            for name, probe in LOCK_PROBES.items()
        )
    )
    held = os.open(sandbox.python, os.O_RDONLY)
    try:
        import fcntl

        fcntl.flock(held, fcntl.LOCK_EX)
        other = os.open(sandbox.python, os.O_RDONLY)  # a POSIX lock of this process, beside the flock of another file
        fcntl.lockf(other, fcntl.LOCK_SH)
        unfiltered = Sandbox(LIMITS, protections=()).run(code)
        filtered = sandbox.run(code)
        os.close(other)
    finally:
        os.close(held)
    assert unfiltered.ok and "flock seen" in unfiltered.stdout, unfiltered  # without the filter: the host's lock
    assert filtered.ok and filtered.stdout.split("\n")[:-1] == [f"{name} refused" for name in LOCK_PROBES], filtered


@needs_isolation
def test_a_program_cannot_make_waits_of_its_own_for_the_wall_clock_to_deduct():
    # The wall clock deducts the waits for a CPU of the program's first process. Reniced to 19 and pinned to one CPU
    # beside a spinning child, that process waited most of the time: it ran 6 s under a 2 s limit, to the backstop
    # (issue 49's review). The filter refuses every change of scheduling: Python raises PermissionError, the program
    # goes on, and its first process keeps the scheduling it was given, whatever the machine's load.
    code = (
        "import os\nbefore = os.sched_getaffinity(0)\n"
        "for change in (lambda: os.nice(19), lambda: os.setpriority(os.PRIO_PROCESS, 0, 19),\n"
        "               lambda: os.sched_setaffinity(0, {min(before)}),\n"
        "               lambda: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)),\n"
        "               lambda: os.sched_setparam(0, os.sched_param(0))):\n"
        "    try:\n        change()\n        print('changed')\n"
        "    except PermissionError:\n        print('refused')\n"
        "print(os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0) == os.SCHED_OTHER,\n"
        "      os.sched_getaffinity(0) == before)\n"
    )
    run = Sandbox(LIMITS).run(code)
    given = f"{os.getpriority(os.PRIO_PROCESS, 0)} True True"  # the trainer's nice value, which the program inherits
    assert run.ok and run.stdout.splitlines() == ["refused"] * 5 + [given], (run.stdout, run.stderr[-500:])


@needs_isolation
def test_what_is_not_enforced_is_said_once_in_one_line(caplog, monkeypatch):
    monkeypatch.setattr("colograd.rewards.sandbox.MemoryCgroups.find", classmethod(lambda cls: None))
    monkeypatch.setattr("colograd.rewards.sandbox._said", set())
    with caplog.at_level("WARNING", logger="colograd.rewards.sandbox"):
        Sandbox(LIMITS)
        Sandbox(LIMITS)
    lines = [r.getMessage() for r in caplog.records if "not enforced" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "memory is bounded per process" in lines[0]
    assert set(PROTECTIONS) - {"memory_cgroup"} <= set(Sandbox(LIMITS).protections)


def test_a_launcher_that_fails_is_the_sandboxs_failure_not_the_programs(tmp_path, monkeypatch):
    sandbox = Sandbox(LIMITS)
    crashing = tmp_path / "launch.py"
    crashing.write_text("import sys\nsys.stdin.read()\nraise ValueError('the launcher broke')\n")
    monkeypatch.setattr("colograd.rewards.sandbox.LAUNCHER", str(crashing))
    run = sandbox.run("print(1)")
    assert run.reason == "sandbox failed" and "ValueError" in run.stderr


def test_any_input_of_any_size_reaches_the_program():
    sandbox = Sandbox(LIMITS)
    big = "".join(f"{i}\n" for i in range(1_500_000))  # 10 MiB
    assert len(big) > 10 << 20
    run = sandbox.run("import sys\nprint(sum(int(line) for line in sys.stdin))", big)
    assert run.ok and run.stdout == f"{sum(range(1_500_000))}\n"
    odd = "a\ud800b \udcff\n"  # lone surrogates: kept as their bytes both ways
    run = sandbox.run("print(input())", odd)
    assert run.ok and run.stdout == odd


# --- limits over the whole process tree -----------------------------------------------------------------------------
# RLIMIT_CPU counts one process. These programs hand their work on to children they keep forking, or make children
# that wait for a CPU, so that only a count over the whole tree, and a wall clock that deducts no wait of theirs,
# stops them. Each runs with the tree's CPU time read from the cgroup, and from /proc (the fallback without one).

TREE = SandboxLimits(wall_s=10.0, cpu_s=1, memory_mib=256)
RELAY = """
import os, time

def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def relay(done):
    for _ in range(10):
        burn(0.8)  # under the 1 s each process may use
        if os.fork():
            os._exit(0)  # this link ends; its child carries the work on, with a CPU clock of its own
    os.write(done, b"x")
    os._exit(0)

def add(a, b):
    ready, done = os.pipe()
    for _ in range(2):  # a relay on each core: 16 s of CPU in all
        if os.fork() == 0:
            relay(done)
    os.close(done)
    while os.read(ready, 1):  # until each relay's last link has written and ended
        pass
    return a + b
"""


def tree_sandbox(limits: SandboxLimits, accounting: str) -> Sandbox:
    """A sandbox whose tree's CPU time is read from its cgroup ("cgroup"), or from /proc ("proc")."""
    if accounting == "proc":
        return Sandbox(limits, protections=[p for p in PROTECTIONS if p != "cpu_cgroup"])
    sandbox = Sandbox(limits)
    if "cpu_cgroup" not in sandbox.protections:
        pytest.skip("no writable cpuacct cgroup on this machine")
    return sandbox


@needs_isolation
@pytest.mark.parametrize("accounting", ["cgroup", "proc"])
def test_cpu_time_is_counted_over_the_whole_process_tree(accounting):
    # Relays of children, each using 0.8 s of CPU and forking the next: the add they compute takes 16 s of CPU (8 s
    # on both cores), under a 1 s limit. Counted over the tree, it is stopped for its CPU time within seconds and
    # scores 0, as a program and as a row's solution; counted per process, it ran until the wall clock.
    sandbox = tree_sandbox(TREE, accounting)
    start = time.monotonic()
    run = sandbox.run(RELAY + "print(add(3, 4))")
    program_s = time.monotonic() - start
    start = time.monotonic()
    solution = run_asserts(sandbox, AssertTests("", "", ("assert add(1, 2) == 3",)), RELAY)
    solution_s = time.monotonic() - start
    assert (run.reason, run.stdout) == ("cpu time", ""), run
    assert solution.failures == ["cpu time"], solution
    assert program_s < TREE.wall_s and solution_s < TREE.wall_s, (program_s, solution_s)


@needs_isolation
@pytest.mark.parametrize("accounting", ["cgroup", "proc"])
def test_waits_of_the_programs_own_children_do_not_lengthen_its_wall_time(accounting):
    # A program that sleeps, beside 6 orphaned children spinning on the machine's cores (so each waits for a CPU most
    # of the time), with CPU time to spare: the CPUs are all the tree's, so their waits are no stall of it, and it
    # times out at its wall limit, on whatever share of the machine it gets. (Deducting the waits of every child of
    # the sandbox's pid 1, it ran to the backstop; deducting their sum, it would run until its 30 s of CPU time.)
    limits = SandboxLimits(wall_s=1.5, cpu_s=30, memory_mib=256)
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"  # a middle process, so that the spinners are orphans: the sandbox's pid 1's children
        "    for _ in range(6):\n"
        "        if os.fork() == 0:\n"
        "            while True:\n"
        "                pass\n"
        "    os._exit(0)\n"
        "time.sleep(1000)\n"
    )
    sandbox = tree_sandbox(limits, accounting)
    start = time.monotonic()
    run = sandbox.run(code)
    elapsed = time.monotonic() - start
    assert run.reason == "timeout" and limits.wall_s <= elapsed, (run.reason, elapsed)


def busy_machine(per_core: int = 6) -> list[subprocess.Popen]:
    """Processes spinning on the machine's cores, `per_core` to a core, each in a session of its own, as separate
    jobs are: with the kernel's autogroups, processes of one session share one slice of the CPU."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(per_core * os.cpu_count())]  # fmt: skip


@needs_isolation
def test_a_multiprocessing_programs_workers_waits_count_like_its_first_process():
    # Issue 62: a pool's two workers compute (~0.25 s of CPU each) while the program's first process waits for them,
    # on a machine whose cores are 6 times oversubscribed: the sandbox gets ~1/6.5 of a core, so the pool takes ~4 s
    # on the clock under a 1.5 s wall limit. Deducting only the first process's waits (it sleeps), it timed out; the
    # workers' stalls deducted, it passes, as on a machine of its own, where it takes ~0.4 s.
    code = (
        "import multiprocessing as mp\n"
        "def work(n):\n    return sum(i * i for i in range(n))\n"
        "if __name__ == '__main__':\n"
        "    with mp.Pool(2) as pool:\n        print(len(pool.map(work, [2_500_000, 2_500_000])))\n"
    )
    busy = busy_machine()
    try:
        runs = [Sandbox(SandboxLimits(wall_s=1.5, cpu_s=5)).run(code) for _ in range(2)]
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert [(r.reason, r.stdout) for r in runs] == [(None, "2\n")] * 2, [(r.reason, r.seconds) for r in runs]


class NoCpu:
    def seconds(self) -> float:
        return 0.0


def clock_verdict(launcher: subprocess.Popen, wall_s: float, until_s: float) -> tuple[str | None, float]:
    """`Clock`'s verdict on an unisolated launcher (its first child stands for the program), read as the sandbox reads
    it until `until_s`, and when it came."""
    clock = Clock(launcher.pid, isolated=False, wall_s=wall_s, cpu_s=1000, cpu=NoCpu(), cores=1)
    while (elapsed := time.perf_counter() - clock.created) < until_s:
        verdict, wait = clock.check()
        if verdict:
            return verdict, elapsed
        time.sleep(min(wait, POLL_S))
    return None, elapsed


def test_a_wait_for_a_cpu_under_way_is_not_counted():
    # The kernel adds a wait to schedstat only when it ends. A program that waits throughout (here in the idle class,
    # beside a process spinning on its CPU; on a busy machine, a program or judge just forked waited over a second
    # before its first turn) showed no wait at all, and was timed out at the wall limit; watched, its wait is
    # deducted, and it runs on (to the backstop at 3 s).
    cpu = min(os.sched_getaffinity(0))
    starved = (
        "import os\n"
        "if os.fork() == 0:\n"  # the program: runnable throughout, never running
        f"    os.sched_setaffinity(0, {{{cpu}}})\n"
        "    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
        "    while True:\n        pass\n"
        "if os.fork() == 0:\n"  # in the same session (one group for the scheduler), spinning on the same CPU
        f"    os.sched_setaffinity(0, {{{cpu}}})\n"
        "    while True:\n        pass\n"
        "os.wait()\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", starved], start_new_session=True)
    try:
        verdict, at = clock_verdict(launcher, wall_s=1.0, until_s=2.5)
        assert verdict is None, at
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_children_spinning_beside_each_other_buy_no_wall_time():
    # The program sleeps beside 6 children spinning on the machine's cores: each waits for a CPU most of the time,
    # but the CPUs are all the tree's, so the clock deducts none of it, and the tree gets the CPU time a machine of
    # its own gives it in the wall limit (its cores for 1 s), whatever else the machine runs. Deducting the sum of
    # their waits, or their waits as stalls without the bound of the cores, it used 3 times that and more.
    spinners = (
        "import os, time\npid = os.fork()\nif pid == 0:\n"
        "    for _ in range(6):\n        if os.fork() == 0:\n            while True:\n                pass\n"
        "    time.sleep(100)\nos.waitpid(pid, 0)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", spinners], start_new_session=True)
    cores = len(os.sched_getaffinity(0))
    try:
        clock = Clock(launcher.pid, isolated=False, wall_s=1.0, cpu_s=1000, cpu=NoCpu(), cores=cores)
        while not (verdict := clock.check())[0] and time.perf_counter() - clock.created < 60:
            time.sleep(min(verdict[1], POLL_S))
        used = ProcTreeCpu(launcher.pid).seconds()
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    assert verdict[0] == "timeout" and used < 1.5 * cores + 0.5, (verdict, used)


def test_the_wall_clock_starts_once_the_program_is_there():
    # Building the sandbox can sleep in the kernel (RCU grace periods when it joins its cgroup and detaches the old
    # root, a fork waiting while another sandbox joins its cgroup): over a second under load, none of it the
    # program's. Here the launcher sleeps 0.8 s before it forks the program, which sleeps: timed out at its wall limit
    # after that, not during it.
    launcher = subprocess.Popen([sys.executable, "-c", "import os, time\ntime.sleep(0.8)\nif os.fork() == 0:\n"
                                 "    time.sleep(100)\nos.wait()\n"], start_new_session=True)  # fmt: skip
    try:
        verdict, at = clock_verdict(launcher, wall_s=1.0, until_s=3.5)
        assert verdict == "timeout" and at >= 1.8, at
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_a_program_never_seen_is_timed_from_its_launch():
    # A program whose first process forks and exits at once is never among the processes the clock waits for: the
    # wall clock starts from the launch once the limit has passed, not never (which left it to the backstop, 3x).
    # The launcher reaps it at once, as the sandbox's pid 1 does.
    launcher = subprocess.Popen([sys.executable, "-c", "import os, time\npid = os.fork()\nif pid == 0:\n"
                                 "    if os.fork() == 0:\n        time.sleep(100)\n    os._exit(0)\n"
                                 "os.waitpid(pid, 0)\ntime.sleep(100)\n"], start_new_session=True)  # fmt: skip
    try:
        verdict, at = clock_verdict(launcher, wall_s=1.0, until_s=2.5)
        assert verdict == "timeout" and at < 2.5, at
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_a_busy_machine_does_not_turn_a_correct_program_into_a_timeout():
    # Programs that compute for ~0.3 s of CPU (with the interpreter's start), on a machine whose cores are 6 times
    # oversubscribed for the whole test, under a wall limit of 1.5 s: they take longer than that on the clock (~2.3 s
    # on the project's 2 cores with other tests running beside; with the waits counted, they all time out), but the
    # wall limit does not count their waits for a CPU, and their CPU time is well within cpu_s. The oversubscription
    # fixes the sandbox's share of the CPU (one session among 12 busy ones: ~1/6.5 of a core) whatever else runs, so
    # the clock time stays far from the 4.5 s backstop: nearly twice as much load again beside the test still
    # passes. Each busy process has a session of its own, as separate jobs do: with the kernel's autogroups,
    # processes of one session share one slice of the CPU, so busy ones in a single session would leave the sandbox
    # (its own session) half.
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(6 * os.cpu_count())]  # fmt: skip
    work = "sum(i * i for i in range(6_000_000))"
    try:
        sandbox = Sandbox(SandboxLimits(wall_s=1.5, cpu_s=5))
        runs = [sandbox.run(f"a, b = map(int, input().split())\n{work}\nprint(a + b)", "3 4\n") for _ in range(2)]
        asserts = [run_asserts(sandbox, AssertTests("", "", ("assert add(1, 2) == 3",)),
                               f"def add(a, b):\n    {work}\n    return a + b\n") for _ in range(2)]  # fmt: skip
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert [(r.reason, r.stdout) for r in runs] == [(None, "7\n")] * 2
    assert [a.failures for a in asserts] == [[None]] * 2


@pytest.mark.slow
def test_reward_calls_in_parallel_on_a_busy_machine_score_every_correct_program_one():
    # Issue 49: with 3 reward calls in parallel at reduced limits, 1 correct completion in 24 timed out. A process the
    # sandbox has just forked can wait over a second for its first turn on a CPU when the cores are oversubscribed,
    # and the kernel adds a wait to schedstat only once it ends: the wall clock deducted none of such a wait, and also
    # counted the sandbox's setup, which can sleep in the kernel as long. Here the cores are oversubscribed as in the
    # test above, and three calls of one reward (the trainer shares one) score 8 correct completions each, one layout
    # a call, each ~0.2 s of CPU under a 1.5 s wall limit: ~2 s on the clock on the share the machine leaves it, far
    # from the 4.5 s backstop (it fails when no wait is deducted).
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(6 * os.cpu_count())]  # fmt: skip
    work = "sum(i * i for i in range(3_000_000))"
    add = f"def add(a, b):\n    {work}\n    return a + b\n"
    stdio = {"language": "python", "test_cases": [{"input": "3 4\n", "output": "7\n"}]}
    calls = [
        ("a, b = map(int, input().split())\n" + work + "\nprint(a + b)\n", {"verification_info": stdio}),
        (add, {"test_list": ["assert add(1, 2) == 3", "assert add(0, 5) == 5"]}),
        (add, {"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"}),
    ]
    code = CodeReward(limits=SandboxLimits(wall_s=1.5, cpu_s=5), workers=2)

    def call(program: str, row: dict) -> list[str | None]:
        completions = [f"```python\n# completion {i}\n{program}```" for i in range(8)]  # 8 executions, not 1
        failures = {}
        code(completions, **{k: [v] * 8 for k, v in row.items()}, log_extra=lambda _, v: failures.update(v=v))
        return failures["v"]

    try:
        with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
            failures = list(pool.map(lambda args: call(*args), calls))
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert failures == [[None] * 8] * 3


@needs_isolation
def test_multiprocessing_works_with_a_private_dev_shm():
    # multiprocessing's locks and queues are POSIX semaphores in /dev/shm: each sandbox has its own, empty.
    code = (
        "import multiprocessing as mp, os\ndef square(x):\n    return x * x\nif __name__ == '__main__':\n"
        "    print(os.listdir('/dev/shm'))\n    q = mp.Queue(); q.put(3); print(q.get())\n"
        "    with mp.Pool(2) as pool:\n        print(pool.map(square, [1, 2, 3]))\n"
    )
    run = Sandbox(LIMITS).run(code)
    assert run.ok and run.stdout.split("\n")[:3] == ["[]", "3", "[1, 4, 9]"], run.stderr[-500:]


@needs_isolation
def test_multiprocessing_pools_work_in_a_rows_solution():
    # In the assert-style layouts (MBPP, HumanEval) the program is the module ``solution``: a pool pickles `square` by
    # reference, so its workers find it only if ``solution`` is in sys.modules, as an imported module would be.
    code = (
        "import multiprocessing as mp\ndef square(x):\n    return x * x\n"
        "def squares(xs):\n    with mp.Pool(2) as pool:\n        return pool.map(square, xs)\n"
    )
    tests = AssertTests("", "", ("assert squares([1, 2, 3]) == [1, 4, 9]", "assert squares([]) == []"))
    solution = run_asserts(Sandbox(LIMITS), tests, code)
    assert solution.failures == [None, None], (solution.failures, solution.execution.stderr[-500:])
