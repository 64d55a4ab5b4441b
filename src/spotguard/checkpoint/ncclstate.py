"""What spotguard's NCCL shim reports of a job's processes, and the arithmetic on it: which
counts bring every rank level with its peers (:func:`owed`), and why ranks are not level
(:func:`stuck`). Shared by :mod:`.ncclctl` (one VM's ranks) and :mod:`.ncclgroup` (the ranks
of a group's jobs on several VMs, whose members come from the controller)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .procfacts import comm


@dataclass(frozen=True)
class Comm:
    """One communicator of one process, as its shim reports it."""

    id: int
    key: str
    rank: int
    nranks: int
    dev: int
    ops: int
    send: dict[int, int] = field(default_factory=dict)
    recv: dict[int, int] = field(default_factory=dict)
    captured: int = 0
    registered: int = 0
    windows: int = 0
    devapi: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Comm:
        return cls(
            id=int(d["id"]),
            key=str(d["key"]),
            rank=int(d["rank"]),
            nranks=int(d["nranks"]),
            dev=int(d["dev"]),
            ops=int(d["ops"]),
            send={int(p): int(n) for p, n in d.get("send", [])},
            recv={int(p): int(n) for p, n in d.get("recv", [])},
            captured=int(d.get("captured", 0)),
            registered=int(d.get("registered", 0)),
            windows=int(d.get("windows", 0)),
            devapi=int(d.get("devapi", 0)),
        )

    def refusals(self) -> list[tuple[str, str]]:
        """What keeps it from being released: (what, what to do)."""
        out = []
        if self.captured:
            out.append(
                (
                    f"NCCL collectives captured in a CUDA graph ({self.captured} calls on a "
                    "capturing stream)",
                    "a graph replays the communicator's resources, which a release destroys: "
                    "do not capture NCCL calls, or run the job with 'spotguard run --nccl "
                    "restrict'",
                )
            )
        if self.registered:
            out.append(
                (
                    f"{self.registered} user buffers registered with ncclCommRegister",
                    "deregister them before a checkpoint, or run with 'spotguard run --nccl "
                    "restrict' (PyTorch: TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=0)",
                )
            )
        if self.windows:
            out.append(
                (
                    f"{self.windows} NCCL memory windows (ncclCommWindowRegister)",
                    "release them before a checkpoint, or run with 'spotguard run --nccl "
                    "restrict' (PyTorch: no NCCL symmetric memory)",
                )
            )
        if self.devapi:
            out.append(
                (
                    "NCCL's device API (ncclDevCommCreate)",
                    "device communicators cannot be rebuilt: run with 'spotguard run --nccl "
                    "restrict'",
                )
            )
        return out


@dataclass(frozen=True)
class Member:
    """A process of the job with communicators, and its last report."""

    pid: int
    sock: Path
    state: str
    inflight: int
    memalloc: int
    comms: tuple[Comm, ...]
    #: the job of another VM that reported it (:mod:`.ncclgroup`); "" for this VM's
    where: str = ""

    @classmethod
    def from_json(cls, pid: int, sock: Path, d: dict[str, Any]) -> Member:
        return cls(
            pid,
            sock,
            str(d["state"]),
            int(d.get("inflight", 0)),
            int(d.get("memalloc", 0)),
            tuple(Comm.from_json(c) for c in d.get("comms", [])),
        )

    def label(self, c: Comm | None = None) -> str:
        who = (
            f"pid {self.pid} of job {self.where}"
            if self.where
            else f"pid {self.pid} ({comm(self.pid)})"
        )
        if c is None:
            return who
        return f"{who}, rank {c.rank} of {c.nranks} of communicator {c.key[:8]}"


def groups_of(members: Iterable[Member]) -> dict[str, list[tuple[Member, Comm]]]:
    out: dict[str, list[tuple[Member, Comm]]] = {}
    for m in members:
        for c in m.comms:
            out.setdefault(c.key, []).append((m, c))
    return out


def owed(members: Sequence[Member]) -> list[list[str]]:
    """Per member (in ``members``' order), the drain targets that bring it level with its
    peers: every member of a communicator issues as many collectives as the one furthest
    ahead, and as many sends to (receives from) each peer as that peer posted receives from
    (sends to) it. Only targets above a process's own counts are listed; empty lists
    everywhere mean all are level. By position, since members of other VMs' jobs
    (:mod:`.ncclgroup`) may have the same pids as this VM's."""
    where = {id(m): n for n, m in enumerate(members)}
    out: list[list[str]] = [[] for _ in members]
    for members_of in groups_of(members).values():
        top = max(c.ops for _, c in members_of)
        by_rank = {c.rank: c for _, c in members_of}
        for m, c in members_of:
            mine = out[where[id(m)]]
            if c.ops < top:
                mine.append(f"c{c.id}={top}")
            for peer, peer_c in by_rank.items():
                want_send = peer_c.recv.get(c.rank, 0)
                want_recv = peer_c.send.get(c.rank, 0)
                if want_send > c.send.get(peer, 0):
                    mine.append(f"s{c.id}.{peer}={want_send}")
                if want_recv > c.recv.get(peer, 0):
                    mine.append(f"r{c.id}.{peer}={want_recv}")
    return out


def targets(members: Sequence[Member]) -> dict[int, list[str]]:
    """:func:`owed` by pid (the members of one job: their pids are distinct)."""
    return {m.pid: t for m, t in zip(members, owed(members), strict=True)}


def level(members: Sequence[Member]) -> bool:
    return all(m.inflight == 0 for m in members) and not any(owed(members))


def stuck(members: Sequence[Member]) -> str:
    """Why ``members`` are not level, naming each rank that holds it up."""
    parts = []
    for m, owes in zip(members, owed(members), strict=True):
        if m.inflight:
            parts.append(f"{m.label()} is inside an NCCL call")
        elif owes:
            parts.append(f"{m.label()} is behind its peers ({len(owes)} counts)")
    return "; ".join(parts) or "the ranks' counts kept moving"
