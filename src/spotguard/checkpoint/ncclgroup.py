"""NCCL communicators whose ranks span VMs: release and rebuild them together with the agents
of the other VMs, through a meeting point (:class:`Peers`: the controller's rendezvous).

A multi-VM NCCL run is one spotguard job per VM, all started with ``spotguard run
--nccl-group NAME`` (the job's processes carry ``SPOTGUARD_NCCL_GROUP``). One agent sees only
its own ranks, so the steps of :mod:`.ncclctl` that compare ranks are taken on the union of
every job's reports, exchanged in named **rounds** (:mod:`spotguard.groupwire`):

* **release** — the agent opens (or joins) a freeze generation ``g`` of the group
  (:meth:`Peers.begin`; the other members' agents see it and freeze their jobs too), closes
  its ranks' gates, then in rounds ``g{g}-r{i}`` posts its ranks' counts and waits for every
  rank of every communicator it is connected to; all agents compute the same drain targets
  from the same union, drain their own ranks, and release once the union is level. An agent
  whose time runs out posts ``abort`` in the next round: every agent then fails its freeze
  and opens its gates again.
* **rebuild** — after the resume (same generation) or the restore (a generation of mode
  ``restore`` opened or joined by the restored members), round ``rebuild`` collects every
  released rank; the agent of each communicator's lowest rank asks its process for a fresh
  ``ncclUniqueId`` and posts it in round ``uids``; every agent rebuilds its ranks with them.

Deciding on the union only of the jobs connected to this one (by shared communicators) makes
every agent of a component decide the same, whatever unrelated jobs share the group's name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol

from spotguard.errors import NcclError
from spotguard.groupwire import GROUP_ENV, CommReport, MemberReport, RoundEntry

from . import ncclstate
from .procfacts import read_environ

log = logging.getLogger(__name__)

#: no local socket: a member reported by another VM's agent
REMOTE = Path("/nonexistent")


class Peers(Protocol):
    """The meeting point of one job's agent with the agents of the rest of its group."""

    async def begin(self, mode: str, reason: str) -> int:
        """Open (or join) a freeze generation of the group (``mode`` ``exit``, ``resume`` or
        ``restore``); its number."""
        ...

    async def exchange(
        self,
        name: str,
        entry: RoundEntry,
        complete: Callable[[list[RoundEntry]], bool],
        wait_s: float,
    ) -> list[RoundEntry]:
        """Post ``entry`` in round ``name`` and return the round's entries once ``complete``
        says they are all there; :class:`NcclError` after ``wait_s`` seconds."""
        ...


#: the meeting point of job ``job`` of group ``group`` (the agent's, with a controller;
#: None without one)
PeersFactory = Callable[[str, str], "Peers | None"]


def group_of(members: Sequence[ncclstate.Member]) -> str | None:
    """The group the job's NCCL processes were started in (``spotguard run --nccl-group``)."""
    for m in members:
        if m.sock != REMOTE and (g := read_environ(m.pid).get(GROUP_ENV)):
            return g
    return None


def spanning(members: Sequence[ncclstate.Member]) -> list[str]:
    """Keys of the communicators some of whose ranks are not among ``members``."""
    ranks: dict[str, set[int]] = {}
    size: dict[str, int] = {}
    for m in members:
        for c in m.comms:
            ranks.setdefault(c.key, set()).add(c.rank)
            size[c.key] = c.nranks
    return sorted(k for k, r in ranks.items() if len(r) != size[k])


def report(m: ncclstate.Member) -> MemberReport:
    """``m`` on the wire."""
    return MemberReport(
        pid=m.pid,
        state=m.state,
        inflight=m.inflight,
        memalloc=m.memalloc,
        comms=[
            CommReport(
                id=c.id,
                key=c.key,
                rank=c.rank,
                nranks=c.nranks,
                dev=c.dev,
                ops=c.ops,
                send=sorted(c.send.items()),
                recv=sorted(c.recv.items()),
                captured=c.captured,
                registered=c.registered,
                windows=c.windows,
                devapi=c.devapi,
            )
            for c in m.comms
        ],
    )


def _member(r: MemberReport, job: str) -> ncclstate.Member:
    comms = tuple(
        ncclstate.Comm(
            c.id,
            c.key,
            c.rank,
            c.nranks,
            c.dev,
            c.ops,
            dict(c.send),
            dict(c.recv),
            c.captured,
            c.registered,
            c.windows,
            c.devapi,
        )
        for c in r.comms
    )
    return ncclstate.Member(r.pid, REMOTE, r.state, r.inflight, r.memalloc, comms, where=job)


def connected(entries: Sequence[RoundEntry], job: str) -> list[RoundEntry]:
    """The entries of ``job`` and of every job sharing a communicator with it, transitively."""
    keys_of = {e.job: {c.key for m in e.members for c in m.comms} for e in entries}
    seen, todo = {job}, [job]
    while todo:
        keys = keys_of.get(todo.pop(), set())
        for other, theirs in keys_of.items():
            if other not in seen and keys & theirs:
                seen.add(other)
                todo.append(other)
    return [e for e in entries if e.job in seen]


def covered(entries: Sequence[RoundEntry], job: str) -> bool:
    """True when the jobs connected to ``job`` report every rank of every communicator they
    hold, or one of the entries gives up (``abort``)."""
    if any(e.abort for e in entries):
        return True
    ranks: dict[str, set[int]] = {}
    size: dict[str, int] = {}
    mine = connected(entries, job)
    if not any(e.job == job for e in mine):
        return False
    for e in mine:
        for m in e.members:
            for c in m.comms:
                ranks.setdefault(c.key, set()).add(c.rank)
                size[c.key] = c.nranks
    return all(len(r) == size[k] for k, r in ranks.items())


def union(
    local: Sequence[ncclstate.Member], entries: Sequence[RoundEntry], job: str
) -> list[ncclstate.Member]:
    """``local`` (this job's members, with their sockets) and the other connected jobs'."""
    others = [
        _member(r, e.job) for e in connected(entries, job) if e.job != job for r in e.members
    ]  # fmt: skip
    return [*local, *others]


def check(entries: Sequence[RoundEntry], job: str) -> None:
    """Refuse a round in which two members report the same rank of a communicator, or
    disagree on its size: a member's agent is confused, or a caller that is not a member
    posted in the group's round (:class:`NcclError`; the freeze or rebuild is given up)."""
    seen: dict[tuple[str, int], str] = {}
    size: dict[str, int] = {}
    for e in connected(entries, job):
        for m in e.members:
            for c in m.comms:
                who = f"job {e.job} pid {m.pid}"
                if (c.key, c.rank) in seen:
                    raise NcclError(
                        f"NCCL group round: {seen[c.key, c.rank]} and {who} both report rank "
                        f"{c.rank} of communicator {c.key[:8]}; given up"
                    )
                if size.setdefault(c.key, c.nranks) != c.nranks:
                    raise NcclError(
                        f"NCCL group round: {who} reports communicator {c.key[:8]} with "
                        f"{c.nranks} ranks, others with {size[c.key]}; given up"
                    )
                seen[c.key, c.rank] = who


def _aborted(entries: Sequence[RoundEntry]) -> str | None:
    why = [f"job {e.job}: {e.abort}" for e in entries if e.abort]
    return "; ".join(why) or None


async def level_together(
    job: str,
    members: list[ncclstate.Member],
    peers: Peers,
    generation: int,
    drain: Callable[
        [list[ncclstate.Member], dict[int, list[str]], int], Awaitable[list[ncclstate.Member]]
    ],
    wait_s: float,
) -> list[ncclstate.Member]:
    """Bring this job's quiesced ``members`` level with the rest of the group (see the
    module's docstring); returns them level. ``drain(members, owed, ms)`` drains the local
    ones to their targets for up to ``ms`` and returns their new reports (awaitable)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    i = 0
    while True:
        left = deadline - loop.time()
        entry = RoundEntry(job=job, members=[report(m) for m in members])
        if left <= 0:
            entry = entry.model_copy(update={"abort": "its ranks did not level in time"})
        entries = await peers.exchange(
            f"g{generation}-r{i}", entry, lambda es: covered(es, job), max(left, 1.0)
        )
        if (why := _aborted(entries)) is not None:
            both = union(members, [e for e in entries if not e.abort], job)
            raise NcclError(
                f"NCCL ranks of job {job!r}'s group did not quiesce together ({why}): "
                f"{ncclstate.stuck(both)}; the job runs on"
            )
        check(entries, job)
        both = union(members, entries, job)
        every = ncclstate.owed(both)
        if all(m.inflight == 0 for m in both) and not any(every):
            return members
        mine = {m.pid: every[n] for n, m in enumerate(both[: len(members)])}
        ms = max(int(min(max(left, 0.0), 0.5) * 1000), 1)
        members = await drain(members, mine, ms)
        i += 1


async def uids_together(
    job: str,
    members: list[ncclstate.Member],
    peers: Peers,
    ask_uid: Callable[[ncclstate.Member], Awaitable[str]],
    wait_s: float,
) -> dict[str, str]:
    """The fresh ``ncclUniqueId`` of every communicator ``members`` hold (key → uid): this
    job gives those whose lowest rank it holds, the other jobs the rest (rounds ``rebuild``
    and ``uids``)."""
    entries = await peers.exchange(
        "rebuild",
        RoundEntry(job=job, members=[report(m) for m in members]),
        lambda es: covered(es, job),
        wait_s,
    )
    if (why := _aborted(entries)) is not None:
        raise NcclError(f"the rebuild of job {job!r}'s group was given up ({why})")
    check(entries, job)
    lowest: dict[str, tuple[int, ncclstate.Member]] = {}
    for m in union(members, entries, job):
        for c in m.comms:
            if c.key not in lowest or c.rank < lowest[c.key][0]:
                lowest[c.key] = (c.rank, m)
    giver = {key: m.where or job for key, (_, m) in lowest.items()}
    given: dict[str, str] = {}
    for key, (_, m) in sorted(lowest.items()):
        if m.sock != REMOTE:
            given[key] = await ask_uid(m)
    needed = {c.key for m in members for c in m.comms}

    def from_givers(es: Sequence[RoundEntry]) -> dict[str, str]:
        """Each communicator's id as its giver posted it (no other job's word is taken)."""
        return {k: u for e in es for k, u in e.uids.items() if giver.get(k) == e.job}

    def all_given(es: list[RoundEntry]) -> bool:
        return any(e.abort for e in es) or needed <= from_givers(es).keys()

    entries = await peers.exchange("uids", RoundEntry(job=job, uids=given), all_given, wait_s)
    if (why := _aborted(entries)) is not None:
        raise NcclError(f"the rebuild of job {job!r}'s group was given up ({why})")
    uids = from_givers(entries)
    log.info(
        "NCCL group rebuild met",
        extra={"job": job, "jobs": sorted(e.job for e in entries), "given": sorted(given)},
    )
    return {k: uids[k] for k in needed}
