"""The kernel's socket-diagnostics netlink (``NETLINK_SOCK_DIAG``): list the TCP connections in
TIME_WAIT on some local ports and destroy them (``SOCK_DESTROY``).

Why here and by hand: restore clears a job's own closed connections off the ports it listens
on (:func:`.sockets.clear_time_wait`), and this is the kernel's one interface for it. iproute2's
``ss -K`` speaks the same protocol but is not installed on every GPU image (the lent GPU
machines have none), and no maintained Python library sends ``SOCK_DESTROY`` (pyroute2's
diagnostics socket only lists). The protocol is four fixed C structures (linux/inet_diag.h).
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
SOCK_DESTROY = 21
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
TCP_TIME_WAIT = 6

_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
#: struct inet_diag_sockid: sport, dport (network order), src[16], dst[16], if, cookie[2]
_SOCKID = struct.Struct("!HH16s16s")
_SOCKID_TAIL = struct.Struct("=III")
_REQ = struct.Struct("=BBBxI")  # inet_diag_req_v2 before its sockid
_MSG = struct.Struct("=BBBB")  # inet_diag_msg before its sockid
SOCKID_LEN = _SOCKID.size + _SOCKID_TAIL.size  # 48


class DiagError(OSError):
    """The kernel refused a request (``errno``: EOPNOTSUPP without CONFIG_INET_DIAG_DESTROY,
    EPERM without CAP_NET_ADMIN)."""


@dataclass(frozen=True)
class TimeWait:
    """One TCP connection in TIME_WAIT: its family, local port and the kernel's raw socket id
    (what ``SOCK_DESTROY`` needs back, cookie included)."""

    family: int
    sport: int
    sockid: bytes


def _request(sock: socket.socket, kind: int, flags: int, seq: int, body: bytes) -> None:
    sock.send(_NLMSG.pack(_NLMSG.size + len(body), kind, NLM_F_REQUEST | flags, seq, 0) + body)


def _replies(sock: socket.socket, seq: int) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of each reply to ``seq`` until the dump's end or an ack/error."""
    while True:
        data = sock.recv(1 << 16)
        off = 0
        while off + _NLMSG.size <= len(data):
            length, kind, _flags, got, _pid = _NLMSG.unpack_from(data, off)
            if length < _NLMSG.size:
                return
            payload = data[off + _NLMSG.size : off + length]
            off += (length + 3) & ~3
            if got != seq:
                continue
            if kind == NLMSG_DONE:
                return
            if kind == NLMSG_ERROR:
                (err,) = struct.unpack_from("=i", payload)
                if err:
                    raise DiagError(-err, os.strerror(-err))
                return
            yield kind, payload


def time_wait(sock: socket.socket, ports: set[int], seq: int = 1) -> list[TimeWait]:
    """The TCP connections in TIME_WAIT (IPv4 and IPv6) whose local port is in ``ports``."""
    out: list[TimeWait] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        seq += 1
        body = _REQ.pack(family, socket.IPPROTO_TCP, 0, 1 << TCP_TIME_WAIT) + bytes(SOCKID_LEN)
        _request(sock, SOCK_DIAG_BY_FAMILY, NLM_F_DUMP, seq, body)
        for kind, payload in _replies(sock, seq):
            if kind != SOCK_DIAG_BY_FAMILY or len(payload) < _MSG.size + SOCKID_LEN:
                continue
            fam, state, _timer, _retrans = _MSG.unpack_from(payload)
            sockid = payload[_MSG.size : _MSG.size + SOCKID_LEN]
            sport = _SOCKID.unpack_from(sockid)[0]
            if state == TCP_TIME_WAIT and sport in ports:
                out.append(TimeWait(fam, sport, sockid))
    return out


def destroy(sock: socket.socket, conn: TimeWait, seq: int) -> None:
    """``SOCK_DESTROY`` one connection (:class:`DiagError` if the kernel refuses; a connection
    that is already gone is not an error)."""
    body = _REQ.pack(conn.family, socket.IPPROTO_TCP, 0, 1 << TCP_TIME_WAIT) + conn.sockid
    _request(sock, SOCK_DESTROY, NLM_F_ACK, seq, body)
    try:
        for _ in _replies(sock, seq):
            pass
    except DiagError as exc:
        if exc.errno != 2:  # ENOENT: it timed out meanwhile
            raise


def destroy_time_wait(ports: set[int]) -> int:
    """Destroy every TCP connection in TIME_WAIT on ``ports`` in this network namespace; how
    many were destroyed. :class:`DiagError` (or another ``OSError``) when the kernel refuses."""
    if not ports:
        return 0
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(5)
        conns = time_wait(sock, ports)
        for seq, conn in enumerate(conns, start=100):
            destroy(sock, conn, seq)
    return len(conns)
