"""A script's end without the interpreter's teardown (`colograd.runs.process_exit.exit_now`): what an exit does that
matters still happens. Each case runs in a process of its own (a few lines of Python, no engine)."""

import gzip
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, _env

# The module alone, without the package's imports (torch, transformers): a few milliseconds a case, not seconds.
_IMPORT = f"""
import importlib.util
_spec = importlib.util.spec_from_file_location("process_exit", {str(ROOT / "colograd/runs/process_exit.py")!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
exit_now, run_then_exit = _module.exit_now, _module.run_then_exit
"""


def _run(body: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(_IMPORT + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(), cwd=tmp_path)


def test_the_exit_code_atexit_handlers_and_unflushed_files_survive_and_the_teardown_is_skipped(tmp_path):
    proc = _run(
        """
        import atexit, gzip, sys, tempfile, weakref

        log = open("log.txt", "w")  # never flushed nor closed: the teardown would flush it
        log.write("the last line\\n")
        binary = open("data.bin", "wb", buffering=1 << 20)
        binary.write(b"x" * 1000)
        packed = gzip.open("log.jsonl.gz", "wt")  # its trailer is written only when it closes
        packed.write('{"step": 1}\\n')
        folder = tempfile.TemporaryDirectory(dir=".")  # removed by its weakref.finalize, an atexit callback
        open("folder.txt", "w").write(folder.name)
        atexit.register(lambda: open("atexit.txt", "w").write("ran"))

        class Teardown:
            def __del__(self):
                open("teardown.txt", "w").write("ran")

        kept = Teardown()  # a module global: only the interpreter's teardown deletes it
        print("printed, not flushed", end="")
        sys.stderr.write("said")
        exit_now(3)
        """,
        tmp_path,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "printed, not flushed" and proc.stderr == "said"
    assert (tmp_path / "log.txt").read_text() == "the last line\n"
    assert (tmp_path / "data.bin").read_bytes() == b"x" * 1000
    assert gzip.decompress((tmp_path / "log.jsonl.gz").read_bytes()) == b'{"step": 1}\n'
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    folder = tmp_path / (tmp_path / "folder.txt").read_text()
    assert not folder.exists()
    assert not (tmp_path / "teardown.txt").exists()  # the teardown did not run: what makes the exit fast


@pytest.mark.parametrize(
    ("code", "returncode", "stderr"), [(None, 0, ""), ("stopped: why", 1, "stopped: why\n"), (["x"], 1, "['x']\n")]
)
def test_a_code_is_read_as_sys_exit_reads_it(tmp_path, code, returncode, stderr):
    proc = _run(f"exit_now({code!r})\n", tmp_path)
    assert (proc.returncode, proc.stderr) == (returncode, stderr)


def test_a_thread_still_running_is_waited_for_as_pythons_exit_waits(tmp_path):
    proc = _run(
        """
        import threading, time

        def work():
            time.sleep(0.5)
            open("thread.txt", "w").write("finished")

        threading.Thread(target=work).start()
        exit_now(4)
        """,
        tmp_path,
    )
    assert proc.returncode == 4 and (tmp_path / "thread.txt").read_text() == "finished"


def test_a_script_run_through_it_exits_with_its_code_and_an_exception_as_python_ends_it(tmp_path):
    """`run_then_exit(main)`, as colograd/train.py ends: SystemExit's code is the process's; an exception is
    printed with its traceback and exits 1, as Python does."""
    stopped = _run("import sys\nrun_then_exit(lambda: sys.exit(2))\n", tmp_path)
    assert stopped.returncode == 2 and stopped.stderr == ""
    finished = _run("run_then_exit(lambda: print('trained'))\n", tmp_path)
    assert finished.returncode == 0 and finished.stdout == "trained\n"
    raised = _run("def main():\n    raise RuntimeError('boom')\nrun_then_exit(main)\n", tmp_path)
    assert raised.returncode == 1 and raised.stderr.splitlines()[-1] == "RuntimeError: boom"
    assert "Traceback" in raised.stderr
