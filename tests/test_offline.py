"""The suite's network guard (tests/offline/network_guard.py, installed by tests/conftest.py): nothing a test runs,
in this process or in one it starts, reaches another machine, so a test that would download passes nowhere, rather
than here and slowly, or online and by downloading."""

import socket
import subprocess
import sys
from unittest.mock import patch

import pytest


def test_a_connection_off_the_machine_fails_the_test_at_once():
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): unroutable, so unguarded the connect times out or is refused, never this
    with pytest.raises(pytest.fail.Exception, match=r"192\.0\.2\.1:443, off this machine"):
        socket.create_connection(("192.0.2.1", 443), timeout=2)


def test_a_hub_download_fails_the_test_before_any_retry(tmp_path):
    """As a test that set HF_HUB_OFFLINE after the hub was imported would reach for it (the library read it at
    import): the name's lookup is refused, a failure no retry loop of the library's catches."""
    import huggingface_hub

    with patch("huggingface_hub.constants.HF_HUB_OFFLINE", False):
        with pytest.raises(pytest.fail.Exception, match=r"huggingface\.co:443, off this machine"):
            huggingface_hub.hf_hub_download("gpt2", "config.json", cache_dir=tmp_path)


def test_this_machine_stays_reachable():
    """Loopback and the machine's own name: the launcher's store, a local server a test starts."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        for host in ("127.0.0.1", "localhost"):
            with socket.create_connection((host, port), timeout=5):
                server.accept()[0].close()


def test_a_process_a_test_starts_is_guarded_from_its_start():
    """A launched rank, a script a test runs: its interpreter installs the guard as it starts (the suite's
    `sitecustomize`, on the PYTHONPATH every process a test starts inherits), so the reach ends the process with the
    same line, past a library's `except Exception`."""
    reach = (
        "import socket\ntry:\n    socket.create_connection(('192.0.2.1', 443), timeout=2)\n"
        "except Exception as err:\n    print('caught', type(err).__name__)"
    )
    done = subprocess.run([sys.executable, "-c", reach], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "caught" not in done.stdout, done.stdout + done.stderr
    assert "OffTheMachine: the test reached for 192.0.2.1:443, off this machine" in done.stderr
