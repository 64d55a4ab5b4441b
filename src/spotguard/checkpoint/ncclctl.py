"""The agent's side of the NCCL shim: release a job's NCCL communicators before the GPU lock
and rebuild them after the restore or the resume, so NCCL keeps its fast transports.

Why: the driver checkpoint API cannot capture what NCCL's P2P, SHM and NVLS transports share
between processes and GPUs. ``spotguard run`` preloads spotguard's NCCL shim
(``packaging/nccl-shim``, built by ``scripts/install-nccl-shim``): the job's communicators
are the shim's handles, and each process that has one listens on a unix socket,
``$SPOTGUARD_NCCL_CTL/<pid>.sock`` (``<pid>`` as the process sees itself; the directory is
:func:`control_dir`, root only). This module speaks to those sockets (one request line, one
JSON answer; the shim's source documents the commands):

* :meth:`NcclControl.release` — every rank of the job at once: refuse what cannot be released
  (:class:`~spotguard.errors.UndumpableError`, naming it: collectives captured in CUDA graphs,
  buffers registered with ``ncclCommRegister``, windows, ``ncclMemAlloc`` memory, the device
  API, communicators with ranks outside the job unless their group's agents meet through the
  controller: :mod:`.ncclgroup`), close every gate (``quiesce``), let ranks that are behind
  their peers issue what they owe (``drain``) until every rank of every communicator has
  issued the same operations and none is inside NCCL, then ``release``
  (``ncclCommFinalize`` + ``ncclCommDestroy``). A rank that does not get there within the
  lock timeout fails the checkpoint in one line (:class:`~spotguard.errors.NcclError`); every
  gate is opened again (:meth:`NcclControl.bring_back`) and the job runs on.
* :meth:`NcclControl.rebuild` — the agent is the rendezvous: for each communicator (its group
  key) it asks one member for a fresh ``ncclUniqueId`` and hands it to every member, which
  create their communicators again concurrently with the recorded rank, size, device and
  configuration, and open their gates.

Processes without the shim are untouched (``spotguard run --nccl restrict`` jobs, jobs adopted
by pid): the freeze preflight judges their NCCL settings (:mod:`.nccl`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard.errors import NcclError, UndumpableError

from . import ncclgroup
from .ncclstate import Comm as Comm
from .ncclstate import Member as Member
from .ncclstate import groups_of, level, stuck
from .ncclstate import owed as owed
from .ncclstate import targets as targets
from .procfacts import comm, read_environ
from .proctree import ns_pids
from .settings import CheckpointSettings

__all__ = [
    "CTL_ROOT",
    "ENV_CTL",
    "SHIM_FILE",
    "Comm",
    "Member",
    "NcclControl",
    "Outcome",
    "control_dir",
    "prepare_restore",
    "shim_loaded",
]

log = logging.getLogger(__name__)

#: the shim's file name (what /proc/<pid>/maps shows of a process that has it loaded)
SHIM_FILE = "libspotguard_nccl.so"
#: where each job's control directory lives (root only; tmpfs)
CTL_ROOT = Path("/run/spotguard/nccl")
#: the job's environment variable naming its control directory
ENV_CTL = "SPOTGUARD_NCCL_CTL"
#: longest single drain round: ranks' new counts are exchanged this often
DRAIN_ROUND_S = 0.5


def control_dir(job: str) -> Path:
    """The control directory of job ``job`` (the same on every VM it is restored on)."""
    return CTL_ROOT / job


def shim_loaded(pid: int) -> bool:
    """True if the process has spotguard's NCCL shim mapped."""
    try:
        return SHIM_FILE in Path(f"/proc/{pid}/maps").read_text(errors="replace")
    except OSError:
        return False


def _socket_of(pid: int) -> Path | None:
    """The process's control socket, if it has one (it opens it with its first communicator)."""
    where = read_environ(pid).get(ENV_CTL)
    inner = ns_pids(pid)
    if not where or not inner:
        return None
    sock = Path(where) / f"{inner[-1]}.sock"
    return sock if sock.exists() else None


def prepare_restore(job: str) -> None:
    """Before ``criu restore``: the job's control directory exists (root only) and holds no
    socket left by the job's last run (the restored processes bind theirs again)."""
    d = control_dir(job)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    d.chmod(0o700)
    for stale in d.glob("*.sock"):
        stale.unlink(missing_ok=True)


@dataclass(frozen=True)
class Outcome:
    """What a release or a rebuild did: communicators, processes, seconds."""

    communicators: int = 0
    pids: tuple[int, ...] = ()
    seconds: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {"communicators": self.communicators, "pids": list(self.pids)}


async def _ask(pid: int, sock: Path, line: str, limit: float) -> dict[str, Any]:
    """Send one command to a process's shim and return its answer (NcclError on failure)."""
    what = line.split(" ", 1)[0]
    try:
        async with asyncio.timeout(limit):
            reader, writer = await asyncio.open_unix_connection(str(sock))
            try:
                writer.write(line.encode() + b"\n")
                await writer.drain()
                raw = await reader.read()
            finally:
                writer.close()
    except TimeoutError as exc:
        raise NcclError(f"pid {pid}: NCCL shim did not answer {what!r} in {limit:.0f} s") from exc
    except OSError as exc:
        raise NcclError(f"pid {pid}: NCCL shim unreachable at {sock}: {exc}") from exc
    try:
        data: dict[str, Any] = json.loads(raw)
    except ValueError as exc:
        raise NcclError(f"pid {pid}: NCCL shim answered {what!r} with {raw[:200]!r}") from exc
    if "error" in data:
        raise NcclError(f"pid {pid} ({comm(pid)}): NCCL shim {what}: {data['error']}")
    return data


def _outcome(
    job: str, what: str, done: Sequence[Mapping[str, Any]], members: Sequence[Member], t0: float
) -> Outcome:
    """What a release or rebuild did (``what``: the answers' count field), logged in one line:
    the done-means check reads "NCCL communicators released" / "rebuilt" from the log."""
    out = Outcome(
        sum(int(d.get(what, 0)) for d in done),
        tuple(m.pid for m in members),
        time.monotonic() - t0,
    )
    log.info(
        f"NCCL communicators {what}",
        extra={
            "job": job,
            "communicators": out.communicators,
            "gpu_pids": list(out.pids),
            "seconds": round(out.seconds, 3),
        },
    )
    return out


class NcclControl:
    """Release, rebuild and bring back a job's NCCL communicators through the shim; with
    ``peers`` (a factory of meeting points, :mod:`.ncclgroup`), also communicators whose
    ranks span the jobs of a group on several VMs."""

    def __init__(
        self,
        call_timeout: float = 300.0,
        peers: ncclgroup.PeersFactory | None = None,
        group_join_s: float = 20.0,
        group_wait_s: float = 600.0,
    ) -> None:
        self.call_timeout = call_timeout
        self.peers = peers
        self.group_join_s = group_join_s  # a freeze's wait for the group's other agents
        self.group_wait_s = group_wait_s  # a restored member's wait for the others

    @classmethod
    def of(cls, settings: CheckpointSettings) -> NcclControl:
        """The control these settings describe (no meeting points: the agent adds its)."""
        return cls(
            call_timeout=settings.gpu_timeout,
            group_join_s=settings.nccl_group_join_s,
            group_wait_s=settings.nccl_group_wait_s,
        )

    def _meeting(
        self, job: str, members: Sequence[Member], mode: str = "exit"
    ) -> ncclgroup.Peers | None:
        """The group's meeting point when ``members``' communicators span other jobs of its
        group (None without one, and for a ``park``: the others cannot wait at their gates)."""
        if self.peers is None or mode == "park" or not ncclgroup.spanning(members):
            return None
        group = ncclgroup.group_of(members)
        return self.peers(group, job) if group else None

    async def members(self, tree: Iterable[int]) -> list[Member]:
        """The processes of ``tree`` whose shim has communicators, with their reports."""
        found = [(p, s) for p in tree if shim_loaded(p) and (s := _socket_of(p)) is not None]
        answers = await asyncio.gather(*(_ask(p, s, "state", 10.0) for p, s in found))
        return [
            Member.from_json(p, s, a)
            for (p, s), a in zip(found, answers, strict=True)
            if a["comms"]
        ]

    async def _all(
        self, members: Sequence[Member], lines: dict[int, str], t: float
    ) -> list[Member]:
        answers = await asyncio.gather(*(_ask(m.pid, m.sock, lines[m.pid], t) for m in members))
        return [Member.from_json(m.pid, m.sock, a) for m, a in zip(members, answers, strict=True)]

    def _refuse(self, job: str, members: Sequence[Member], grouped: bool) -> None:
        found = []
        for m in members:
            found += [
                f"{m.label(c)} holds {what}: {fix}" for c in m.comms for what, fix in c.refusals()
            ]
            if m.memalloc:
                found.append(
                    f"{m.label()} holds {m.memalloc} buffers from ncclMemAlloc: NCCL's "
                    "allocator's memory cannot be carried by a release; free them before a "
                    "checkpoint, or run with 'spotguard run --nccl restrict'"
                )
        for key, members_of in groups_of(members).items():
            nranks = members_of[0][1].nranks
            ranks = sorted({c.rank for _, c in members_of})
            if len(ranks) != nranks and not grouped:
                found.append(
                    f"communicator {key[:8]} has {len(ranks)} of its {nranks} ranks in this job "
                    f"(ranks {', '.join(map(str, ranks))}): start every VM's part of the run "
                    "with 'spotguard run --nccl-group NAME' under a controller (its agents "
                    "then release and rebuild it together), or run with 'spotguard run --nccl "
                    "restrict'"
                )
        if found:
            raise UndumpableError(job, found)

    async def release(
        self, job: str, tree: Sequence[int], wait_s: float, mode: str = "exit"
    ) -> Outcome:
        """Quiesce every rank at once and release every communicator of ``tree``'s
        processes; see the module's docstring. Communicators spanning other jobs of the
        job's group are levelled with those jobs' agents (:mod:`.ncclgroup`; ``mode`` opens
        the group's freeze: ``exit``, ``resume``, or ``park``). On failure every gate is
        open again."""
        t0 = time.monotonic()
        members = await self.members(tree)
        if not members:
            return Outcome()
        meet = self._meeting(job, members, mode)
        self._refuse(job, members, meet is not None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s + (self.group_join_s if meet is not None else 0.0)
        try:
            generation = await meet.begin(mode, f"{mode} checkpoint") if meet else 0
            members = await self._all(members, {m.pid: "quiesce" for m in members}, 10.0)
            if meet is not None:
                members = await ncclgroup.level_together(
                    job, members, meet, generation, self._drain, deadline - loop.time()
                )
            while not level(members):
                left = deadline - loop.time()
                if left <= 0:
                    raise NcclError(
                        f"NCCL ranks of job {job!r} did not quiesce in {wait_s:.0f} s: "
                        f"{stuck(members)}; the job runs on"
                    )
                ms = max(int(min(left, DRAIN_ROUND_S) * 1000), 1)
                members = await self._drain(members, targets(members), ms)
            ms = int(self.call_timeout * 1000)
            done = await asyncio.gather(
                *(_ask(m.pid, m.sock, f"release {ms}", self.call_timeout + 5) for m in members)
            )
        except BaseException:
            await asyncio.shield(self.bring_back(job, tree))
            raise
        return _outcome(job, "released", done, members, t0)

    async def _drain(
        self, members: list[Member], owes: dict[int, list[str]], ms: int
    ) -> list[Member]:
        """Let each member issue what it owes (``owes``, by pid) for up to ``ms``."""
        lines = {m.pid: " ".join(["drain", str(ms), *owes.get(m.pid, [])]) for m in members}
        return await self._all(members, lines, ms / 1000 + 10.0)

    async def rebuild(self, job: str, tree: Sequence[int], restored: bool = False) -> Outcome:
        """Create every released communicator of ``tree``'s processes again: the agent is
        the rendezvous (one fresh ncclUniqueId per communicator, from one of its members),
        with the other jobs' agents for communicators spanning the job's group (after a
        restore, ``restored``, the group's restored members meet in a new generation)."""
        t0 = time.monotonic()
        members = [m for m in await self.members(tree) if m.state == "released"]
        if not members:
            return Outcome()
        meet = self._meeting(job, members)
        if meet is not None:
            if restored:
                await meet.begin("restore", "rebuild after the restore")
            uid_of = await ncclgroup.uids_together(job, members, meet, self._uid, self.group_wait_s)
        else:
            groups = groups_of(members)
            givers = {key: min(mc, key=lambda x: x[1].rank)[0] for key, mc in groups.items()}
            uids = await asyncio.gather(*(self._uid(g) for g in givers.values()))
            uid_of = dict(zip(givers, uids, strict=True))
        ms = int(self.call_timeout * 1000)
        lines = {
            m.pid: " ".join(["rebuild", str(ms), *(f"{c.id}={uid_of[c.key]}" for c in m.comms)])
            for m in members
        }
        done = await asyncio.gather(
            *(_ask(m.pid, m.sock, lines[m.pid], self.call_timeout + 5) for m in members)
        )
        return _outcome(job, "rebuilt", done, members, t0)

    async def _uid(self, m: Member) -> str:
        """A fresh ncclUniqueId from member ``m``'s process (hex)."""
        return str((await _ask(m.pid, m.sock, "uid", self.call_timeout))["uid"])

    async def bring_back(self, job: str, tree: Sequence[int]) -> None:
        """After a failed freeze: open every closed gate and rebuild what was released.
        Never raises (it runs on the failure path); what fails is logged."""
        try:
            members = await self.members(tree)
            closed = [m for m in members if m.state in ("closed", "draining")]
            await self._all(closed, {m.pid: "reopen" for m in closed}, 10.0)
            if any(m.state == "released" for m in members):
                await self.rebuild(job, tree)
        except (NcclError, OSError) as exc:
            log.error(
                "could not bring NCCL communicators back", extra={"job": job, "error": str(exc)}
            )
