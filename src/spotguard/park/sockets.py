"""The TCP sockets of a job's process tree, read from /proc: where it listens, and how many
bytes its connections have moved.

Parking needs the listening addresses (wake-on-connect listens on them while the job is
parked); the idle policy needs traffic. Both are found the same way: each fd of the tree that
links to ``socket:[inode]`` is looked up in the kernel's socket tables
(``/proc/<pid>/net/tcp`` and ``tcp6``, which show the job's network namespace).

Byte counters come from ``TCP_INFO`` (``tcpi_bytes_acked`` / ``tcpi_bytes_received``) on a
duplicate of the job's socket taken with ``pidfd_getfd(2)`` (Linux 5.6+, root) and closed at
once: the kernel keeps exact per-connection counters there and nowhere else that is
readable per process without netlink. psutil and the standard library have neither
``pidfd_getfd`` nor ``TCP_INFO`` parsing, hence the small ctypes call.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"
_ESTABLISHED = "01"
_SYS_PIDFD_GETFD = 438  # same number on x86-64 and aarch64 (generic syscall table)
_TCP_INFO_LEN = 232
_BYTES_ACKED = 120  # offsetof(struct tcp_info, tcpi_bytes_acked)
_BYTES_RECEIVED = 128  # offsetof(struct tcp_info, tcpi_bytes_received)


@dataclass(frozen=True, order=True)
class Address:
    """A TCP address a job listens on: ``host`` is an IP literal (``0.0.0.0`` / ``::`` = all)."""

    host: str
    port: int

    @property
    def family(self) -> socket.AddressFamily:
        return socket.AF_INET6 if ":" in self.host else socket.AF_INET

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def to_json(self) -> dict[str, str | int]:
        return {"host": self.host, "port": self.port}


@dataclass(frozen=True)
class SocketRef:
    """One TCP socket of the tree: which process holds it (pid, fd), its state and address.

    ``waiting`` is the kernel's ``rx_queue``: for a listening socket the connections waiting
    to be accepted, for a connection the bytes received and not yet read.
    """

    pid: int
    fd: int
    inode: int
    state: str
    local: Address
    waiting: int = 0


def _decode(hexaddr: str) -> Address:
    """``0100007F:1F90`` (IPv4) or 32 hex digits + port (IPv6), as the kernel prints them."""
    host_hex, port_hex = hexaddr.split(":")
    raw = bytes.fromhex(host_hex)
    # the kernel prints each 32-bit word in host (little-endian) order
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
    packed = b"".join(words)
    ip = ipaddress.ip_address(packed)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return Address(str(ip), int(port_hex, 16))


def _table(pid: int) -> dict[int, tuple[str, Address, int]]:
    """inode → (state, local address, rx_queue) for every TCP socket in ``pid``'s network
    namespace."""
    out: dict[int, tuple[str, Address, int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10:
                continue
            with contextlib.suppress(ValueError):
                rx = int(cols[4].split(":")[1], 16)
                out[int(cols[9])] = (cols[3], _decode(cols[1]), rx)
    return out


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
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith("socket:["):
            found.append((int(name), int(target[8:-1])))
    return found


def tcp_sockets(pids: Iterable[int]) -> list[SocketRef]:
    """Every TCP socket held by the processes (one entry per holding fd)."""
    refs: list[SocketRef] = []
    tables: dict[str, dict[int, tuple[str, Address, int]]] = {}
    for pid in pids:
        try:
            netns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if netns not in tables:
            tables[netns] = _table(pid)
        table = tables[netns]
        for fd, inode in _socket_fds(pid):
            if inode in table:
                state, local, waiting = table[inode]
                refs.append(SocketRef(pid, fd, inode, state, local, waiting))
    return refs


def listening(pids: Iterable[int]) -> list[Address]:
    """The distinct addresses the processes listen on (TCP), sorted."""
    return sorted({r.local for r in tcp_sockets(pids) if r.state == _LISTEN})


def waiting_clients(pids: Iterable[int]) -> int:
    """Connections waiting to be accepted plus connections with unread input, over the tree.

    Non-zero while a stopped (parked in place) job has a client knocking: the kernel completes
    TCP handshakes and buffers data for a stopped process, it just never reads them.
    """
    return sum(
        1
        for r in tcp_sockets(pids)
        if r.waiting and (r.state == _LISTEN or r.state == _ESTABLISHED)
    )


def _pidfd_getfd(pid: int, fd: int) -> int:
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
        dup = _pidfd_getfd(pid, fd)
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
        if ref.state == _LISTEN or ref.inode in out:
            continue
        moved = _bytes_moved(ref.pid, ref.fd)
        if moved is not None:
            out[ref.inode] = moved
    return out


def traffic_between(before: dict[int, int], after: dict[int, int]) -> int:
    """Bytes moved between two :func:`traffic` readings (new connections count in full)."""
    return sum(max(n - before.get(inode, 0), 0) for inode, n in after.items())
