"""Freeze preflight: read what a job's tree holds and refuse, before anything is touched,
a tree CRIU cannot dump — and plan the sockets CRIU can.

Why: a dump that must fail would spend a notice's budget (GPU lock, checkpoint, half a
dump) and end with a CRIU log line as the only explanation. The engine calls :func:`gather`
and :func:`check` in its ``scan`` step, before any GPU lock and before CRIU runs; a refusal
is an :class:`~spotguard.errors.UndumpableError` naming the pid, the process, the resource
and what to do, and the job simply keeps running.

Facts come from /proc (file descriptors, memory maps, environment, the socket tables of the
process's network namespace), gathered by :mod:`.procfacts` (re-exported here):
:class:`ProcFacts` per process, :class:`TreeFacts` for the tree. This module holds the
judgement: rules are plain functions ``(ProcFacts) -> list[Finding]`` in :data:`RULES`; another
part adds one with the :func:`rule` decorator (or passes its own list to :func:`check`).
Built in:

* a session whose leader is outside the process's PID namespace (CRIU cannot dump it);
* io_uring instances (``anon_inode:[io_uring]`` descriptors or mappings);
* CUDA managed memory in a process holding CUDA state (mappings of /dev/nvidia-uvm beyond
  the context's own);
* other anonymous-inode descriptors CRIU 4.2 does not know (perf events, userfaultfd ...);
* sockets of a family CRIU cannot dump (in none of /proc/net/{tcp,udp,raw,unix,netlink,
  packet}: vsock, AF_ALG, AF_XDP, SCTP, RDMA ...);
* device files CRIU cannot carry: RDMA (``/dev/infiniband``), KVM, VFIO, DRM, AMD KFD
  descriptors; mappings of any device other than /dev/zero, those the CRIU plugin is told
  to dump (``plugin_devices``) and NVIDIA's in a process holding CUDA state (the GPU path
  owns those); an inherited /dev/nvidia* mapping in a process without CUDA state (a forked
  worker) with no plugin to carry it is refused, naming the installer.

When the agent starts protecting a job it runs :data:`EARLY_RULES` and :func:`file_findings`
(output files over ``max_file_bytes``, deleted files over ``ghost_limit``: what the capture
step and CRIU refuse at the freeze) through :func:`early_findings`, so status names them at
once rather than at the notice.

:func:`network_plan` decides the TCP options: ``--tcp-established`` exactly when a process
of the tree holds a connected TCP socket, and the network lock CRIU takes while it dumps
them (see docs/limits.md, "Sockets").
"""

from __future__ import annotations

import asyncio
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from spotguard.errors import UndumpableError

from . import files, proctree
from .procfacts import Connection, FdFact, ProcFacts, TreeFacts, comm, gather

if TYPE_CHECKING:
    from .criu import Criu

__all__ = [
    "EARLY_RULES",
    "JOB_ENV_DEFAULTS",
    "RULES",
    "Connection",
    "FdFact",
    "FileLimits",
    "Finding",
    "NetworkLock",
    "NetworkPlan",
    "ProcFacts",
    "Rule",
    "TreeFacts",
    "check",
    "early_findings",
    "file_findings",
    "findings",
    "gather",
    "job_environment",
    "network_plan",
    "rule",
]

#: anonymous inodes CRIU 4.2 dumps (criu/files.c); any other one fails the dump
SUPPORTED_ANON = frozenset(
    {"[eventfd]", "[eventpoll]", "[fanotify]", "[pidfd]", "[signalfd]", "[timerfd]", "inotify"}
)
#: descriptor path prefix → (what it is, what to do)
UNDUMPABLE_DEVICES: dict[str, tuple[str, str]] = {
    "/dev/infiniband/": (
        "an RDMA device (InfiniBand/RoCE verbs)",
        "use TCP instead (for NCCL: NCCL_IB_DISABLE=1)",
    ),
    "/dev/kvm": ("the KVM device", "stop the virtual machine before a checkpoint"),
    "/dev/vfio/": ("a VFIO device", "release the passed-through device before a checkpoint"),
    "/dev/dri/": ("a DRM (graphics) device", "do not open GPU render nodes in the job"),
    "/dev/kfd": ("the AMD KFD device", "AMD GPUs are not supported"),
}
#: device mappings CRIU dumps itself (/dev/zero) or the GPU path handles (NVIDIA)
_MAPPABLE_DEVICES = ("/dev/zero", "/dev/shm/")
_NVIDIA = "/dev/nvidia"
NetworkLock = Literal["auto", "nftables", "iptables", "skip"]


@dataclass(frozen=True)
class Finding:
    """Something in a process that cannot be dumped, and what to do about it."""

    pid: int
    name: str
    resource: str
    why: str
    fix: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.name}) holds {self.resource}: {self.why}; {self.fix}"


Rule = Callable[[ProcFacts], list[Finding]]


# --- rules ------------------------------------------------------------------------------

RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    """Register ``fn`` in :data:`RULES` (a decorator): it runs on every process of every
    tree before each freeze and returns one :class:`Finding` per thing it refuses."""
    RULES.append(fn)
    return fn


def _anon(target: str) -> str | None:
    return target.removeprefix("anon_inode:") if target.startswith("anon_inode:") else None


@rule
def session_leader(proc: ProcFacts) -> list[Finding]:
    """A process whose session leader is outside its PID namespace: CRIU fails the dump
    ("A session leader of N is outside of its pid namespace") with or without
    ``--shell-job``. Seen with processes adopted by pid that a container's shell or a CI
    runner started without a session of their own."""
    if not proc.session_outside:
        return []
    return [
        Finding(
            proc.pid,
            proc.name,
            "a session whose session leader is outside its PID namespace",
            "CRIU cannot dump a process whose session leader it cannot see",
            "start the job in a session of its own ('setsid CMD', or 'spotguard run', which "
            "does so)",
        )
    ]


@rule
def io_uring(proc: ProcFacts) -> list[Finding]:
    """io_uring instances: CRIU cannot dump them (``Unknown ... anon_inode:[io_uring]``)."""
    fds = [f.fd for f in proc.fds if f.target == "anon_inode:[io_uring]"]
    mapped = any(m == "anon_inode:[io_uring]" for m in proc.maps)
    if not fds and not mapped:
        return []
    where = f"fd {', '.join(map(str, fds))}" if fds else "a mapping"
    return [
        Finding(
            proc.pid,
            proc.name,
            f"an io_uring instance ({where})",
            "CRIU cannot dump io_uring",
            "PyTorch's TCPStore (torch.distributed rendezvous) holds one through libuv: start "
            "the job with 'spotguard run' (it sets USE_LIBUV=0) or set USE_LIBUV=0 yourself; "
            "other programs must not use io_uring",
        )
    ]


#: what a CUDA context maps of /dev/nvidia-uvm by itself, per GPU device node the process has
#: open: one 2 MiB range (driver 580, H100); a rank that mapped a peer GPU (NCCL P2P over
#: NVLink) keeps a second one once its communicator is destroyed, which the driver checkpoints
UVM_RANGE_PER_GPU = 2 << 20
_GPU_NODE = re.compile(r"^/dev/nvidia\d+$")


@rule
def managed_memory(proc: ProcFacts) -> list[Finding]:
    """CUDA managed (unified) memory in a process holding CUDA state: every
    cudaMallocManaged range is one more mapping of /dev/nvidia-uvm beside the context's own
    2 MiB, and the driver refuses to checkpoint it (cuCheckpointProcessCheckpoint returns
    CUDA_ERROR_NOT_SUPPORTED [801] and leaves the process locked; measured, driver 580).
    Allowed: one 2 MiB range per GPU device node the process holds open. A small managed
    range within that allowance passes here; the driver's 801 then ends the freeze with the
    same advice (:meth:`spotguard.checkpoint.cuda._Driver.checkpoint`) and the job resumes."""
    sizes = proc.device_maps.get("/dev/nvidia-uvm", ())
    gpus = max(len({f.target for f in proc.fds if _GPU_NODE.match(f.target)}), 1)
    allowed = gpus * UVM_RANGE_PER_GPU
    only_context = len(sizes) <= gpus and sum(sizes) <= allowed
    if not proc.gpu or only_context:
        return []
    # more ranges than GPUs but no more bytes: the smallest range is the managed one
    managed = sum(sizes) - allowed if sum(sizes) > allowed else min(sizes)
    return [
        Finding(
            proc.pid,
            proc.name,
            f"CUDA managed memory ({managed >> 20} MiB mapped through /dev/nvidia-uvm)",
            "the NVIDIA driver cannot checkpoint managed (unified) memory",
            MANAGED_FIX,
        )
    ]


MANAGED_FIX = (
    "allocate with cudaMalloc instead of cudaMallocManaged (in PyTorch: no managed-memory "
    "allocator)"
)


@rule
def anon_inodes(proc: ProcFacts) -> list[Finding]:
    """Anonymous-inode descriptors CRIU does not know (io_uring has its own rule)."""
    kinds: dict[str, list[int]] = {}
    for f in proc.fds:
        kind = _anon(f.target)
        if kind is not None and kind not in SUPPORTED_ANON and kind != "[io_uring]":
            kinds.setdefault(kind, []).append(f.fd)
    return [
        Finding(
            proc.pid,
            proc.name,
            f"anon_inode:{kind} (fd {', '.join(map(str, fds))})",
            "CRIU cannot dump this kind of descriptor",
            "close it before a checkpoint (e.g. stop profilers using perf events)",
        )
        for kind, fds in sorted(kinds.items())
    ]


@rule
def socket_families(proc: ProcFacts) -> list[Finding]:
    """Sockets of a family CRIU cannot dump (none of inet, inet6, unix, netlink, packet)."""
    fds = [fd for fd, sk in proc.sockets if sk.family == "unknown"]
    if not fds:
        return []
    return [
        Finding(
            proc.pid,
            proc.name,
            f"a socket of an unsupported family (fd {', '.join(map(str, fds))})",
            "CRIU dumps only TCP, UDP, raw, unix, netlink and packet sockets",
            "close it before a checkpoint (vsock, AF_ALG, AF_XDP, SCTP and RDMA sockets "
            "cannot be carried)",
        )
    ]


def _device_map_finding(proc: ProcFacts, path: str) -> Finding | None:
    """A mapping of ``path`` CRIU cannot dump, or None."""
    if not path.startswith("/dev/") or path.startswith(_MAPPABLE_DEVICES):
        return None
    if proc.plugin_devices and path.startswith(proc.plugin_devices):
        return None
    if path.startswith(_NVIDIA):
        if proc.gpu:
            return None  # the driver checkpoint releases it before CRIU runs
        return Finding(
            proc.pid,
            proc.name,
            f"a leftover mapping of {path} (inherited from a CUDA process, no CUDA context)",
            "CRIU cannot dump device mappings without spotguard's CRIU plugin",
            "run scripts/install-criu on a host with a C compiler (it builds the plugin), or "
            "start workers with the spawn method",
        )
    return Finding(
        proc.pid,
        proc.name,
        f"a mapping of the device {path}",
        "CRIU cannot dump device memory mappings",
        "unmap it before a checkpoint",
    )


@rule
def devices(proc: ProcFacts) -> list[Finding]:
    """Device files CRIU cannot carry: listed device descriptors, device mappings (see
    :func:`_device_map_finding`)."""
    out: list[Finding] = []
    seen: set[str] = set()
    for f in proc.fds:
        for prefix, (what, fix) in UNDUMPABLE_DEVICES.items():
            if f.target.startswith(prefix) and prefix not in seen:
                seen.add(prefix)
                resource = f"{what} ({f.target}, fd {f.fd})"
                why = "CRIU cannot save the device's state"
                out.append(Finding(proc.pid, proc.name, resource, why, fix))
    for m in proc.maps:
        found = _device_map_finding(proc, m)
        if found is not None:
            out.append(found)
    return out


#: rules that need no GPU facts: the agent runs them when it starts protecting a job, so an
#: operator learns at once (status, a log line) that no notice could save the job as it is
EARLY_RULES: tuple[Rule, ...] = (session_leader, io_uring, anon_inodes, socket_families)


@dataclass(frozen=True)
class FileLimits:
    """What a checkpoint carries of a job's files (``[checkpoint]`` settings): its output
    files up to ``max_file_bytes`` in all (:func:`.files.capture`), each deleted file it
    holds up to ``ghost_limit`` (CRIU's ``--ghost-limit``)."""

    job_dir: Path
    max_file_bytes: int
    ghost_limit: int


def early_findings(pid: int, limits: FileLimits | None = None) -> list[Finding]:
    """What :data:`EARLY_RULES` refuse in ``pid``'s tree now, and with ``limits`` the files
    no checkpoint would carry (:func:`file_findings`). Blocking /proc reads."""
    tree = proctree.tree(pid)
    found = findings(gather(tree), EARLY_RULES)
    if limits is not None:
        found += file_findings(pid, tree, limits)
    return found


def file_findings(root: int, tree: Sequence[int], limits: FileLimits) -> list[Finding]:
    """The files of ``tree`` a checkpoint would refuse: output files (the job directory's
    and those held open for writing) over ``max_file_bytes`` in all — the capture step
    fails the freeze then — and each deleted regular file held open over ``ghost_limit``,
    which CRIU refuses to dump."""
    out: list[Finding] = []
    sizes: dict[Path, int] = {}
    for c in files.candidates(limits.job_dir, proctree.writable_files(tree)):
        try:
            sizes[c.path] = c.path.stat().st_size
        except OSError:
            continue
    total = sum(sizes.values())
    if total > limits.max_file_bytes:
        largest = max(sizes, key=lambda p: sizes[p])
        out.append(
            Finding(
                root,
                comm(root),
                f"output files of {total} bytes (largest {largest}, {sizes[largest]} bytes)",
                f"a checkpoint carries at most max_file_bytes ({limits.max_file_bytes} bytes) "
                "of them",
                "raise [checkpoint] max_file_bytes or keep large outputs outside the job "
                "(docs/limits.md)",
            )
        )
    return out + _ghost_findings(tree, limits.ghost_limit)


def _ghost_findings(tree: Sequence[int], limit: int) -> list[Finding]:
    """Deleted regular files over ``limit`` bytes the processes hold open (each file once)."""
    out: list[Finding] = []
    seen: set[tuple[int, int]] = set()
    for pid in tree:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            deleted = target.startswith("/") and target.endswith(" (deleted)")
            if not deleted or target.startswith("/memfd:") or not stat.S_ISREG(st.st_mode):
                continue
            if st.st_size <= limit or (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            path = target.removesuffix(" (deleted)")
            out.append(
                Finding(
                    pid,
                    comm(pid),
                    f"a deleted file of {st.st_size} bytes ({path}, fd {fd})",
                    f"a checkpoint carries deleted files up to ghost_limit ({limit} bytes)",
                    "raise [checkpoint] ghost_limit or close the file before a checkpoint",
                )
            )
    return out


def findings(facts: TreeFacts, rules: Sequence[Rule] | None = None) -> list[Finding]:
    """What every rule finds in every process."""
    return [f for proc in facts.procs for r in (RULES if rules is None else rules) for f in r(proc)]


def check(job: str, facts: TreeFacts, rules: Sequence[Rule] | None = None) -> None:
    """Raise :class:`UndumpableError` naming everything the rules refuse; return if nothing."""
    found = findings(facts, rules)
    if found:
        raise UndumpableError(job, found)


# --- the job's environment ----------------------------------------------------------------
#: set for every ``spotguard run`` job unless the caller's environment sets them:
#: USE_LIBUV=0 makes PyTorch's TCPStore use its own socket server instead of libuv's,
#: which holds an io_uring (seen with PyTorch 2.11 and 2.13: rank 0 of every
#: torch.distributed job) that CRIU cannot dump.
JOB_ENV_DEFAULTS: dict[str, str] = {"USE_LIBUV": "0"}


def job_environment(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus :data:`JOB_ENV_DEFAULTS` for every key ``base`` leaves unset."""
    return {**JOB_ENV_DEFAULTS, **base}


# --- network ------------------------------------------------------------------------------


@dataclass(frozen=True)
class NetworkPlan:
    """The TCP options of one dump: ``--tcp-established`` and ``--network-lock METHOD``."""

    tcp_established: bool
    lock: str | None
    connections: tuple[Connection, ...] = ()
    #: the local ports of the tree's listening TCP sockets (restore clears closed
    #: connections of the job's last run off them: :func:`.sockets.clear_time_wait`)
    listen_ports: tuple[int, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "tcp_established": self.tcp_established,
            "network_lock": self.lock,
            "tcp_connections": len(self.connections),
            "tcp_external": sum(1 for c in self.connections if not c.internal),
        }


def network_plan(
    job: str,
    facts: TreeFacts,
    *,
    available: Iterable[str],
    setting: NetworkLock = "auto",
    force: bool = False,
) -> NetworkPlan:
    """Choose the TCP options for a dump of ``facts``.

    ``--tcp-established`` when the tree holds a connected TCP socket (or ``force``). The
    lock (setting ``network_lock``; ``auto``): nftables, else iptables, whichever this CRIU
    and host can use (``available``); with neither, ``skip`` — safe only when every
    connection has both ends in the tree, which CRIU freezes as one, so no packet flows
    while the sockets are dumped. A connection to a peer outside the job with no lock is
    refused (:class:`UndumpableError`): its peer could send data that no image holds.

    >>> network_plan("j", TreeFacts(()), available=["nftables"])
    NetworkPlan(tcp_established=False, lock=None, connections=())
    """
    conns = tuple(facts.connections())
    if not conns and not force:
        return NetworkPlan(False, None, conns)
    if setting != "auto":
        return NetworkPlan(True, setting, conns)
    have = set(available)
    for method in ("nftables", "iptables"):
        if method in have:
            return NetworkPlan(True, method, conns)
    outside = [c for c in conns if not c.internal]
    if outside:
        found = [
            Finding(
                c.pid,
                c.name,
                f"a TCP connection to {c.remote} outside the job (fd {c.fd})",
                "dumping it needs a network lock and neither nftables nor iptables works here",
                "enable nf_tables in the kernel or install iptables, close the connection "
                'before a checkpoint, or set network_lock = "skip" to accept that its peer may '
                "lose data sent during the dump",
            )
            for c in outside
        ]
        raise UndumpableError(job, found)
    return NetworkPlan(True, "skip", conns)


async def preflight(
    criu: Criu, lock: NetworkLock, job: str, tree: list[int], gpus: list[int], force_tcp: bool
) -> NetworkPlan:
    """The freeze preflight: refuse a tree CRIU cannot dump (:class:`UndumpableError`, before
    any lock) and plan its TCP options (``lock``: ``[checkpoint] network_lock``)."""
    facts = await asyncio.to_thread(gather, tree, gpus, criu.leftover_prefixes())
    check(job, facts)
    need_locks = force_tcp or bool(facts.connections())
    available = await criu.network_locks() if need_locks else frozenset[str]()
    plan = network_plan(job, facts, available=available, setting=lock, force=force_tcp)
    return replace(plan, listen_ports=tuple(facts.listen_ports()))
