"""The suite's network guard: a name lookup or a stream connection to another machine, from any code of a process it
is installed in, is refused with `refuse` (a BaseException, so that no library's retry loop, which catches Exception,
retries it). Connections to this machine (loopback, its own names and addresses) are a test's own; datagram and Unix
sockets are let through (vLLM finds its own address by a datagram socket that sends nothing).

tests/conftest.py installs it in the test process with pytest's failure; `sitecustomize` (beside this file, on the
PYTHONPATH of every process a test starts) installs it there at interpreter start, refusing with `OffTheMachine`.
"""

import ipaddress
import socket
from collections.abc import Callable
from typing import Any, NoReturn

_connect, _connect_ex, _getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo
_this_machine: set[str] = set()
_refuse: list[Callable[[str], NoReturn]] = []


class OffTheMachine(BaseException):
    """A process a test started reached for another machine."""


def raise_off_the_machine(message: str) -> NoReturn:
    raise OffTheMachine(message)


def install(refuse: Callable[[str], NoReturn]) -> None:
    """Guard this process's sockets; `refuse` is called with a one-line message for each reach off the machine."""
    _refuse[:] = [refuse]
    socket.socket.connect, socket.socket.connect_ex = _guarded_connect, _guarded_connect_ex
    socket.getaddrinfo = _guarded_getaddrinfo


def _host(host: Any) -> str:
    """A host as `connect` and `getaddrinfo` take it (text or bytes, an IPv6 address with a scope), as text."""
    return (host.decode() if isinstance(host, bytes) else str(host)).split("%")[0]


def _address(host: str) -> Any:
    """`host` as an IP address, or None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _off_the_machine(host: str) -> bool:
    """Whether `host` is another machine's."""
    if not _this_machine:
        _this_machine.update({"localhost", socket.gethostname()})
        try:
            _this_machine.update(info[4][0] for info in _getaddrinfo(socket.gethostname(), None))
        except OSError:
            pass
    if host in _this_machine:
        return False
    ip = _address(host)
    return ip is None or not (ip.is_loopback or ip.is_unspecified)


def _refuse_network(host: Any, port: Any) -> None:
    if _off_the_machine(_host(host)):
        _refuse[0](f"the test reached for {host}:{port}, off this machine: tests use no network "
                   "(build the model, tokenizer and data locally; patch a library's offline switch)")  # fmt: skip


def _guarded_getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> list:
    """A name's lookup comes before its connection; without a network it fails, and a library retries it."""
    if host is not None and _address(_host(host)) is None:
        _refuse_network(host, port)
    return _getaddrinfo(host, port, *args, **kwargs)


def _streams_out(sock: socket.socket) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM


def _guarded_connect(sock: socket.socket, address: Any) -> None:
    if _streams_out(sock):
        _refuse_network(*address[:2])
    return _connect(sock, address)


def _guarded_connect_ex(sock: socket.socket, address: Any) -> int:
    if _streams_out(sock):
        _refuse_network(*address[:2])
    return _connect_ex(sock, address)
