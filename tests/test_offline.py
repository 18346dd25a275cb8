"""The suite's network guard (tests/conftest.py): nothing a test runs in this process reaches another machine, so a
test that would download passes nowhere, rather than here and slowly, or online and by downloading."""

import socket
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
