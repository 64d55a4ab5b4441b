"""The TCP sockets of a job's process tree, read from /proc: where it listens, and how many
bytes its connections have moved.

Parking needs the listening addresses (wake-on-connect listens on them while the job is
parked), the waiting clients of a job suspended in place, and, for the idle policy, traffic.
Each fd of the tree that links to ``socket:[inode]`` is looked up in the kernel's socket
tables, read by :mod:`spotguard.checkpoint.sockets` (the same reader the freeze preflight
uses).

Byte counters come from ``TCP_INFO`` (``tcpi_bytes_acked`` / ``tcpi_bytes_received``) on a
duplicate of the job's socket taken with ``pidfd_getfd(2)`` (Linux 5.6+, root) and closed at
once: the kernel keeps exact per-connection counters there and nowhere else that is
readable per process without netlink. psutil and the standard library have neither
``pidfd_getfd`` nor ``TCP_INFO`` parsing, hence the small ctypes call.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from spotguard.checkpoint.sockets import Endpoint, SocketFact, socket_inode, socket_table

_SYS_PIDFD_GETFD = 438  # same number on x86-64 and aarch64 (generic syscall table)
_TCP_INFO_LEN = 232
_BYTES_ACKED = 120  # offsetof(struct tcp_info, tcpi_bytes_acked)
_BYTES_RECEIVED = 128  # offsetof(struct tcp_info, tcpi_bytes_received)

#: a TCP address a job listens on: ``host`` is an IP literal (``0.0.0.0`` / ``::`` = all)
Address = Endpoint


def family_of(addr: Address) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in addr.host else socket.AF_INET


@dataclass(frozen=True)
class SocketRef:
    """One TCP socket of the tree: which process holds it (pid, fd) and what the kernel's
    table says of it (state, local address, ``waiting`` — its rx_queue)."""

    pid: int
    fd: int
    fact: SocketFact


def _socket_fds(pid: int) -> list[tuple[int, int]]:
    """(fd, inode) of every socket fd of ``pid``."""
    found = []
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return []
    for name in names:
        try:
            inode = socket_inode(os.readlink(fd_dir / name))
        except OSError:
            continue
        if inode is not None:
            found.append((int(name), inode))
    return found


def tcp_sockets(pids: Iterable[int]) -> list[SocketRef]:
    """Every TCP socket held by the processes (one entry per holding fd)."""
    refs: list[SocketRef] = []
    tables: dict[str, dict[int, SocketFact]] = {}
    for pid in pids:
        try:
            netns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if netns not in tables:
            tables[netns] = socket_table(pid)
        table = tables[netns]
        for fd, inode in _socket_fds(pid):
            fact = table.get(inode)
            if fact is not None and fact.proto == "tcp":
                refs.append(SocketRef(pid, fd, fact))
    return refs


def listening(pids: Iterable[int]) -> list[Address]:
    """The distinct addresses the processes listen on (TCP), sorted."""
    found = {r.fact.local for r in tcp_sockets(pids) if r.fact.state == "LISTEN"}
    return sorted((a for a in found if a is not None), key=lambda a: (a.host, a.port))


def waiting_clients(pids: Iterable[int]) -> int:
    """Connections waiting to be accepted plus connections with unread input, over the tree.

    Non-zero while a stopped (parked in place) job has a client knocking: the kernel completes
    TCP handshakes and buffers data for a stopped process, it just never reads them.
    """
    return sum(
        1 for r in tcp_sockets(pids) if r.fact.waiting and r.fact.state in ("LISTEN", "ESTABLISHED")
    )


def pidfd_getfd(pid: int, fd: int) -> int:
    """A duplicate, in this process, of ``pid``'s file descriptor ``fd`` (``OSError``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        dup = int(libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0))
        if dup < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return dup
    finally:
        os.close(pidfd)


def _bytes_moved(pid: int, fd: int) -> int | None:
    try:
        dup = pidfd_getfd(pid, fd)
    except OSError:
        return None
    try:
        with socket.socket(fileno=dup) as sock:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    if len(info) < _BYTES_RECEIVED + 8:
        return None
    acked = struct.unpack_from("=Q", info, _BYTES_ACKED)[0]
    received = struct.unpack_from("=Q", info, _BYTES_RECEIVED)[0]
    return int(acked + received)


def traffic(pids: Iterable[int]) -> dict[int, int]:
    """inode → bytes sent (acked) + received so far, for each connected TCP socket.

    Comparing two readings gives the traffic in between: a new inode or a larger count is
    traffic. Sockets whose counters cannot be read are left out.
    """
    out: dict[int, int] = {}
    for ref in tcp_sockets(pids):
        inode = ref.fact.inode
        if ref.fact.state == "LISTEN" or inode in out:
            continue
        moved = _bytes_moved(ref.pid, ref.fd)
        if moved is not None:
            out[inode] = moved
    return out


def traffic_between(before: dict[int, int], after: dict[int, int]) -> int:
    """Bytes moved between two :func:`traffic` readings (new connections count in full)."""
    return sum(max(n - before.get(inode, 0), 0) for inode, n in after.items())
