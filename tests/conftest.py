import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Test this checkout's package, also in subprocesses, whichever checkout the interpreter was installed from.
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def launch(
    script: str,
    *args: str,
    config: str = "recipes/accelerate_configs/cpu.yaml",
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """Run `script` on 2 processes with accelerate's launcher and `config` (the project's CPU config)."""
    return subprocess.run(
        launch_command(script, *args, config=config),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**_env(), **(env or {})},
    )


def start_launch(script: str, *args: str, log: Path) -> subprocess.Popen:
    """Start `launch(script, *args)` without waiting, in a session of its own (so that its whole process group
    can be signalled), its output going to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(
            launch_command(script, *args), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=_env(),
            start_new_session=True,
        )  # fmt: skip


def launch_command(script: str, *args: str, config: str = "recipes/accelerate_configs/cpu.yaml") -> list[str]:
    return [
        str(BIN / "accelerate"), "launch",
        "--config_file", str(ROOT / config),
        "--main_process_port", str(_free_port()),
        script, *args,
    ]  # fmt: skip


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `python colograd/train.py ARGS` in one process."""
    cmd = [sys.executable, str(ROOT / "colograd/train.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_env())


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def root() -> Path:
    return ROOT
