"""The job's own closed connections are cleared off its listening ports through the kernel's
socket diagnostics (``SOCK_DESTROY``), with no ``ss`` on the host: after the clear the port
binds at once instead of after TIME_WAIT's 60 s. Other ports' connections are left alone."""

from __future__ import annotations

import socket
import time

import pytest

from spotguard.checkpoint import sockets


def _closed_first(family: int, host: str) -> int:
    """A listener that accepted a connection and closed it first, then closed itself: the
    accepted side stays in TIME_WAIT on the listener's port. The port."""
    srv = socket.socket(family)
    srv.bind((host, 0))
    srv.listen()
    port: int = srv.getsockname()[1]
    cli = socket.create_connection((host, port))
    conn, _ = srv.accept()
    conn.close()
    time.sleep(0.05)
    cli.close()
    srv.close()
    return port


def _binds(family: int, host: str, port: int) -> bool:
    with socket.socket(family) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


@pytest.mark.parametrize(("family", "host"), [(socket.AF_INET, "127.0.0.1"),
                                              (socket.AF_INET6, "::1")])  # fmt: skip
def test_time_wait_connections_on_the_jobs_ports_are_destroyed(family: int, host: str) -> None:
    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    port = _closed_first(family, host)
    other = _closed_first(family, host)
    assert not _binds(family, host, port)  # what CRIU met: "Address already in use"
    assert sockets.clear_time_wait([port]) == 1
    assert _binds(family, host, port)
    assert port not in sockets.time_wait_ports()
    assert other in sockets.time_wait_ports()  # not one of the job's ports: left alone


def test_nothing_to_clear_is_zero() -> None:
    assert sockets.clear_time_wait([]) == 0
    assert sockets.clear_time_wait([1]) == 0
