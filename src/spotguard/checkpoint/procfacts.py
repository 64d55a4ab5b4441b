"""Facts about a job's process tree, read from /proc: what each process holds (file
descriptors and the sockets behind them, memory maps, device mappings, environment) and the
TCP connections of the tree.

Why a module of their own: the freeze preflight (:mod:`.scan`) judges these facts with plain
rule functions; gathering them is blocking /proc I/O with its own failure modes (a process
that vanishes mid-read, a socket created after its table was read) and is tested apart from
the rules, which take hand-built facts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from spotguard.errors import JobNotFound

from . import proctree
from .proctree import ns_pids
from .sockets import Endpoint, SocketFact, socket_inode, socket_table, unlisted


@dataclass(frozen=True)
class FdFact:
    """One open file descriptor and what /proc/<pid>/fd/<fd> points to."""

    fd: int
    target: str
    socket: SocketFact | None = None


@dataclass(frozen=True)
class ProcFacts:
    """What one process of the tree holds, read from /proc."""

    pid: int
    name: str
    gpu: bool = False  # holds CUDA state (the GPU hook said so)
    fds: tuple[FdFact, ...] = ()
    maps: tuple[str, ...] = ()  # distinct mapped paths, pseudo paths like [heap] included
    environ: Mapping[str, str] = field(default_factory=dict)
    #: device path prefixes spotguard's CRIU plugin dumps as leftovers (Criu.leftover_prefixes)
    plugin_devices: tuple[str, ...] = ()
    #: device file → the size in bytes of each of its mappings
    device_maps: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: its session leader is outside its PID namespace (the process sees its sid as 0)
    session_outside: bool = False

    @property
    def sockets(self) -> list[tuple[int, SocketFact]]:
        return [(f.fd, f.socket) for f in self.fds if f.socket is not None]


@dataclass(frozen=True)
class Connection:
    """A connected TCP socket of the tree; ``internal`` when its peer is in the tree too."""

    pid: int
    name: str
    fd: int
    local: Endpoint
    remote: Endpoint
    state: str
    internal: bool

    def __str__(self) -> str:
        where = "inside the job" if self.internal else "outside the job"
        return f"pid {self.pid} ({self.name}) fd {self.fd}: {self.local} -> {self.remote} ({where})"


@dataclass(frozen=True)
class TreeFacts:
    """Every process of the tree, root first."""

    procs: tuple[ProcFacts, ...]

    def connections(self) -> list[Connection]:
        """Connected TCP sockets; a peer whose endpoints mirror another tree socket is internal."""
        pairs: set[tuple[Endpoint, Endpoint]] = set()
        for p in self.procs:
            for _fd, sk in p.sockets:
                if sk.connected_tcp and sk.local and sk.remote:
                    pairs.add((sk.local, sk.remote))
        out = []
        for p in self.procs:
            for fd, sk in p.sockets:
                if sk.connected_tcp and sk.local and sk.remote:
                    internal = (sk.remote, sk.local) in pairs
                    out.append(
                        Connection(p.pid, p.name, fd, sk.local, sk.remote, sk.state, internal)
                    )
        return out

    def listen_ports(self) -> list[int]:
        """The local ports of the tree's listening TCP sockets (sorted, each once)."""
        return sorted(
            {
                sk.local.port
                for p in self.procs
                for _fd, sk in p.sockets
                if sk.proto == "tcp" and sk.state == "LISTEN" and sk.local
            }
        )

    def to_json(self) -> dict[str, int]:
        conns = self.connections()
        return {
            "processes": len(self.procs),
            "sockets": sum(len(p.sockets) for p in self.procs),
            "tcp_connections": len(conns),
            "tcp_external": sum(1 for c in conns if not c.internal),
        }


def _read_fds(pid: int) -> list[tuple[int, str]]:
    fd_dir = Path(f"/proc/{pid}/fd")
    out: list[tuple[int, str]] = []
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out
    for name in names:
        try:
            out.append((int(name), os.readlink(fd_dir / name)))
        except (OSError, ValueError):
            continue
    return sorted(out)


def _read_maps(pid: int) -> tuple[tuple[str, ...], dict[str, tuple[int, ...]]]:
    """Distinct mapped paths, and the size of every mapping of a device file."""
    seen: dict[str, None] = {}
    devices: dict[str, list[int]] = {}
    try:
        with open(f"/proc/{pid}/maps", errors="replace") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    path = parts[5].rstrip("\n")
                    seen.setdefault(path, None)
                    if path.startswith("/dev/"):
                        start, _, end = parts[0].partition("-")
                        devices.setdefault(path, []).append(int(end, 16) - int(start, 16))
    except (OSError, ValueError):
        return (), {}
    return tuple(seen), {k: tuple(v) for k, v in devices.items()}


def read_environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with (empty if unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def comm(pid: int) -> str:
    """The process's name (``/proc/<pid>/comm``; "?" if it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _net_ns(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return f"pid:{pid}"


def session_outside(pid: int) -> bool:
    """Whether ``pid``'s session leader lies outside ``pid``'s own PID namespace.

    CRIU refuses to dump such a process, ``--shell-job`` or not ("A session leader of N is
    outside of its pid namespace"): a shell in a container or a CI runner that started it
    without setsid. From here the leader is invisible (getsid gives 0), or it sits in a
    shallower namespace, or in another namespace of the same depth.
    """
    try:
        sid = os.getsid(pid)
    except OSError:
        return False
    if sid == 0:
        return True
    depth, leader_depth = len(ns_pids(pid)), len(ns_pids(sid))
    if not depth or not leader_depth:
        return False
    if leader_depth != depth:
        return leader_depth < depth
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") != os.readlink(f"/proc/{sid}/ns/pid")
    except OSError:
        return False


def _proc_facts(
    pid: int, gpu: bool, tables: dict[str, dict[int, SocketFact]], plugin_devices: tuple[str, ...]
) -> ProcFacts:
    ns = _net_ns(pid)
    fds = []
    for fd, target in _read_fds(pid):
        inode = socket_inode(target)
        sk = None
        if inode is not None:
            if ns not in tables:
                tables[ns] = socket_table(pid)
            sk = tables[ns].get(inode)
            if sk is None:  # maybe created after the table was read: read it again once
                tables[ns] = socket_table(pid)
                sk = tables[ns].get(inode) or unlisted(pid, fd, inode)
                if sk is None:
                    continue  # closed since the fds were listed: nothing of it to dump
        fds.append(FdFact(fd, target, sk))
    maps, device_maps = _read_maps(pid)
    env = read_environ(pid)
    return ProcFacts(
        pid,
        comm(pid),
        gpu,
        tuple(fds),
        maps,
        env,
        plugin_devices,
        device_maps,
        session_outside=session_outside(pid),
    )


def start_time(pid: int | str) -> int | None:
    """When ``pid`` started, in clock ticks after boot (``/proc/PID/stat`` field 22): with
    the pid, a process's identity — a pid given to another process after the first one
    ended has another start time. None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def same_process(pid: int, started: int | None) -> bool:
    """Whether ``pid`` is alive and is the process that had start time ``started`` (a
    record without a start time, written by an older spotguard: alive is all we know)."""
    now = start_time(pid)
    return now is not None and proctree.alive(pid) and (started is None or now == started)


def live_tree(root: int) -> tuple[list[int], list[int]]:
    """``root``'s tree as (host pids, pids in their own namespace), root first, leaving out
    the processes that exit while it is read — a job that forks short-lived children (a
    shell loop) always has some. Such a process is not part of any dump: CRIU freezes the
    tree itself and dumps what exists then. Raises :class:`JobNotFound` only when ``root``
    itself is gone."""
    host: list[int] = []
    inner: list[int] = []
    for pid in proctree.tree(root):
        found = ns_pids(pid)
        if found:
            host.append(pid)
            inner.append(found[-1])
        elif pid == root:
            raise JobNotFound(f"no process {root}")
    return host, inner


def gather(
    tree: Sequence[int], gpu_pids: Iterable[int] = (), plugin_devices: Sequence[str] = ()
) -> TreeFacts:
    """Read the facts of every process of ``tree``. A process that vanished before or while
    it was read is left out (what was read of it may be partial: no fds, no maps).
    ``plugin_devices``: device prefixes the CRIU plugin dumps (their mappings are allowed).

    Blocking /proc reads (about a millisecond per process): call it in a thread.
    """
    gpu = set(gpu_pids)
    tables: dict[str, dict[int, SocketFact]] = {}
    devices = tuple(plugin_devices)
    procs = []
    for pid in tree:
        if not Path(f"/proc/{pid}").exists():
            continue
        facts = _proc_facts(pid, pid in gpu, tables, devices)
        if Path(f"/proc/{pid}").exists():  # still there: what was read is whole
            procs.append(facts)
    return TreeFacts(tuple(procs))
