"""Sockets as the kernel's /proc/net tables show them: family, protocol, TCP state and
endpoints, by inode — what the freeze preflight (:mod:`.scan`) needs to tell which
sockets CRIU can dump and which TCP connections stay inside a job.

Each table describes one network namespace (the one of the pid whose ``/proc/<pid>/net`` is
read). A socket in none of them is either an inet socket never bound or connected (the tables
list only sockets in the kernel's hash tables; CRIU dumps these all the same) or one of a
family CRIU does not dump (``unknown``): :func:`unlisted` tells them apart by the protocol name
the socket's inode carries (the ``system.sockprotoname`` attribute of its /proc fd link).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import sockdiag

TCP_STATES = {
    1: "ESTABLISHED",
    2: "SYN_SENT",
    3: "SYN_RECV",
    4: "FIN_WAIT1",
    5: "FIN_WAIT2",
    6: "TIME_WAIT",
    7: "CLOSE",
    8: "CLOSE_WAIT",
    9: "LAST_ACK",
    10: "LISTEN",
    11: "CLOSING",
}
_INET_TABLES = (
    ("tcp", "inet", "tcp"),
    ("tcp6", "inet6", "tcp"),
    ("udp", "inet", "udp"),
    ("udp6", "inet6", "udp"),
    ("udplite", "inet", "udplite"),
    ("udplite6", "inet6", "udplite"),
    ("raw", "inet", "raw"),
    ("raw6", "inet6", "raw"),
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoint:
    """One end of an inet socket."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class SocketFact:
    """A socket as the kernel's /proc/net tables show it (family ``unknown``: in none)."""

    inode: int
    family: str  # inet, inet6, unix, netlink, packet, unknown
    proto: str = ""  # tcp, udp, udplite, raw (inet families only)
    state: str = ""  # TCP state name (tcp only)
    local: Endpoint | None = None
    remote: Endpoint | None = None
    #: the kernel's rx_queue: connections waiting to be accepted (listening TCP), or bytes
    #: received and not yet read (a connection)
    waiting: int = 0

    @property
    def connected_tcp(self) -> bool:
        """A TCP socket CRIU dumps only with ``--tcp-established`` (not listening, not closed)."""
        return self.proto == "tcp" and self.state not in ("LISTEN", "CLOSE")


def _hex_ip(text: str) -> str:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = struct.unpack("<4I", raw)
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))


def parse_endpoint(text: str) -> Endpoint:
    host, port = text.split(":")
    return Endpoint(_hex_ip(host), int(port, 16))


def _inet_table(path: Path, family: str, proto: str) -> dict[int, SocketFact]:
    out: dict[int, SocketFact] = {}
    try:
        lines = path.read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        cols = line.split()
        if len(cols) < 10 or not cols[9].isdigit():
            continue
        state = TCP_STATES.get(int(cols[3], 16), cols[3]) if proto == "tcp" else ""
        inode = int(cols[9])
        local, remote = parse_endpoint(cols[1]), parse_endpoint(cols[2])
        waiting = int(cols[4].split(":")[1], 16) if ":" in cols[4] else 0
        out[inode] = SocketFact(inode, family, proto, state, local, remote, waiting)
    return out


def _inode_table(path: Path, family: str, column: int) -> dict[int, SocketFact]:
    out: dict[int, SocketFact] = {}
    try:
        lines = path.read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        cols = line.split()
        if len(cols) > column and cols[column].isdigit():
            inode = int(cols[column])
            out[inode] = SocketFact(inode, family)
    return out


#: ``system.sockprotoname`` → (family, proto) for sockets CRIU dumps that may be in no table
#: (an inet socket never bound; any socket made after its table was read)
_PROTO_NAMES = {
    "UNIX": ("unix", ""),
    "UNIX-STREAM": ("unix", ""),
    "UNIX-DGRAM": ("unix", ""),
    "NETLINK": ("netlink", ""),
    "PACKET": ("packet", ""),
    "TCP": ("inet", "tcp"),
    "TCPv6": ("inet6", "tcp"),
    "UDP": ("inet", "udp"),
    "UDPv6": ("inet6", "udp"),
    "UDP-Lite": ("inet", "udplite"),
    "UDPLITEv6": ("inet6", "udplite"),
    "RAW": ("inet", "raw"),
    "RAWv6": ("inet6", "raw"),
}


def unlisted(pid: int, fd: int, inode: int) -> SocketFact | None:
    """A socket of ``pid`` (at ``fd``) that no /proc/net table lists: an inet socket never
    bound or connected (state ``CLOSE``, no endpoints), a unix, netlink or packet socket made
    after the table was read, else of a family CRIU does not dump (``unknown``); None when
    ``fd`` no longer holds that socket (closed since the fds were listed: nothing to dump)."""
    where = f"/proc/{pid}/fd/{fd}"
    try:
        name = os.getxattr(where, "system.sockprotoname")
        same = os.stat(where).st_ino == inode
    except FileNotFoundError:
        return None
    except OSError:
        return SocketFact(inode, "unknown")
    if not same:
        return None
    family, proto = _PROTO_NAMES.get(name.rstrip(b"\0").decode(errors="replace"), ("", ""))
    if not family:
        return SocketFact(inode, "unknown")
    return SocketFact(inode, family, proto, "CLOSE" if proto == "tcp" else "")


def socket_table(pid: int) -> dict[int, SocketFact]:
    """Every socket of the network namespace of ``pid``, by inode."""
    net = Path(f"/proc/{pid}/net")
    table: dict[int, SocketFact] = {}
    for name, family, proto in _INET_TABLES:
        table.update(_inet_table(net / name, family, proto))
    table.update(_inode_table(net / "unix", "unix", 6))
    table.update(_inode_table(net / "netlink", "netlink", 9))
    table.update(_inode_table(net / "packet", "packet", 8))
    return table


def time_wait_ports(pid: int | str = "self") -> set[int]:
    """Local ports of the TCP connections in TIME_WAIT in the network namespace of ``pid``:
    closed connections the kernel keeps for 60 s, whose port a new socket without
    SO_REUSEADDR cannot bind (a listener that accepted and closed connections leaves them on
    its own port)."""
    return set(time_wait_counts(pid))


def time_wait_counts(pid: int | str = "self") -> dict[int, int]:
    """How many TCP connections are in TIME_WAIT on each local port, in the network namespace
    of ``pid``. Parsed here: TIME_WAIT entries have no inode, so the table above skips them."""
    counts: dict[int, int] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 3 and int(cols[3], 16) == 6:
                port = parse_endpoint(cols[1]).port
                counts[port] = counts.get(port, 0) + 1
    return counts


def socket_inode(target: str) -> int | None:
    if target.startswith("socket:[") and target.endswith("]"):
        return int(target[8:-1])
    return None


def clear_time_wait(ports: Iterable[int]) -> int:
    """Destroy the TCP connections in TIME_WAIT on ``ports`` in this network namespace; how
    many were destroyed.

    A listener that accepted connections and closed them first (NCCL's bootstrap root at
    start) leaves them in TIME_WAIT on its own port for 60 s, and the kernel refuses to bind
    the port again until then, SO_REUSEADDR or not (the closed connections did not have it).
    A restore on the host the job ran on would wait that out. They are the job's own closed
    connections, on ports its signed image names: the kernel's ``SOCK_DESTROY``
    (:mod:`.sockdiag`) removes them. Where the kernel lacks it (``CONFIG_INET_DIAG_DESTROY``)
    nothing is cleared and restore falls back to waiting (:mod:`.restart`)."""
    wanted = set(ports)
    if not wanted & time_wait_ports():
        return 0
    try:
        return sockdiag.destroy_time_wait(wanted)
    except OSError as exc:
        log.info(
            "closed connections not cleared", extra={"ports": sorted(wanted), "error": str(exc)}
        )
        return 0
