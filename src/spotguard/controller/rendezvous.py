"""The controller as the meeting point of NCCL jobs whose ranks span VMs (:mod:`spotguard.
groupwire` specifies the four routes): per group, its newest freeze generation and, inside
that generation, the named rounds of entries the agents exchange.

Kept in memory only, one :class:`Rendezvous` per controller: a freeze lives for seconds to
minutes, and a controller restarted in the middle of one leaves its agents to time out and
fail that freeze (the job keeps running), which is what they would do without a controller.

What one caller can make it hold is bounded, since any VM token may call it:
:data:`MAX_GROUPS` groups (groups idle for :data:`IDLE_S` are dropped to make room),
:data:`MAX_ROUNDS` rounds per generation, :data:`MAX_ENTRIES` entries per round (and a VM
token puts only its own job's entry, one per round), :data:`MAX_BYTES` bytes of entries in
all. Past a bound the request is refused with :class:`~spotguard.errors.ControllerRefused`
(the API answers 409). Long polls wait at most :data:`MAX_WAIT_S` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spotguard.errors import ControllerRefused
from spotguard.groupwire import FreezeRequest, GroupFreeze, Round, RoundEntry

log = logging.getLogger(__name__)

#: a job joins the open generation only when it was opened less than this many seconds ago
JOIN_WINDOW_S = 600.0
#: at most this many groups (a new one past it is refused, after idle ones are dropped)
MAX_GROUPS = 1024
#: at most this many rounds per generation
MAX_ROUNDS = 256
#: at most this many entries per round (jobs joined per generation, too)
MAX_ENTRIES = 1024
#: at most this many bytes of entries (their JSON) held, all groups together
MAX_BYTES = 512 * 1024 * 1024
#: a group untouched for this long may be dropped
IDLE_S = 86400.0
#: a long poll waits at most this long
MAX_WAIT_S = 30.0


def clamp_wait(wait_s: float) -> float:
    """``wait_s`` within [0, :data:`MAX_WAIT_S`] (NaN: 0)."""
    if wait_s != wait_s:  # NaN
        return 0.0
    return min(max(wait_s, 0.0), MAX_WAIT_S)


def _joins(cur: GroupFreeze, req: FreezeRequest, fresh: bool) -> bool:
    """Whether ``req`` joins the open generation ``cur`` rather than opening the next.

    An ``exit`` in progress takes every member's freeze, asked again or asked as ``resume``
    (the agent then gives way: the group is stopping, its checkpoint follows in ``exit``):
    a later freeze must not forget the rounds the exiting members are levelling in. An
    ``exit`` asked while a ``resume`` is open opens the next (it supersedes it: the members
    of the ``resume`` fail fast and follow). Otherwise a member joins a generation of its own
    mode that it has not joined yet; one asking again opens the next (a second pause)."""
    if not cur.generation or not fresh:
        return False
    if cur.mode == "exit" and req.mode in ("exit", "resume"):
        return True
    return req.mode == cur.mode and req.job not in cur.joined


@dataclass
class _Group:
    """One group's newest generation, its rounds, and what wakes its waiters."""

    freeze: GroupFreeze
    opened: float = 0.0  # the clock's reading when the generation opened
    seen: float = 0.0  # the clock's reading at the last call naming the group
    waiting: int = 0  # calls waiting on it now (a group with waiters is never dropped)
    rounds: dict[str, dict[str, tuple[RoundEntry, int]]] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def wake(self) -> None:
        """Wake every call waiting on this group (each looks again at what it waits for)."""
        self.changed.set()
        self.changed = asyncio.Event()

    def round(self, name: str) -> Round:
        entries = [e for e, _size in self.rounds.get(name, {}).values()]
        return Round(
            group=self.freeze.group, generation=self.freeze.generation, round=name, entries=entries
        )


class Rendezvous:
    """Freeze generations and rounds of every group (see the module's docstring).

    Group and round names are checked by the caller (the API answers 400 for one that is
    not a :data:`spotguard.groupwire.Name`); ``clock`` is monotonic seconds (tests move it).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.groups: dict[str, _Group] = {}
        self.nbytes = 0  # bytes of entries held, all groups together
        self.closed = False  # the controller is stopping: long polls answer at once

    def close(self) -> None:
        """End every long poll now, each with what it has (the controller is stopping and
        its server waits for the requests in flight)."""
        self.closed = True
        for g in self.groups.values():
            g.wake()

    # ----- freeze generations -------------------------------------------------------------

    def open(self, group: str, req: FreezeRequest) -> GroupFreeze:
        """``req.job`` joins the group's open generation (opened less than
        :data:`JOIN_WINDOW_S` ago, by :func:`_joins`' rule), else opens the next one, which
        forgets every round of the older ones. Answers the generation the job is in now."""
        g = self._group(group)
        now, cur = self.clock(), g.freeze
        if _joins(cur, req, now - g.opened < JOIN_WINDOW_S):
            if req.job in cur.joined:
                return cur.model_copy(deep=True)
            if len(cur.joined) >= MAX_ENTRIES:
                raise ControllerRefused(
                    f"group {group!r}: generation {cur.generation} has {MAX_ENTRIES} jobs already"
                )
            cur.joined.append(req.job)
            log.info(
                "NCCL group freeze joined",
                extra={"group": group, "generation": cur.generation, "job": req.job,
                       "mode": cur.mode, "reason": req.reason},
            )  # fmt: skip
        else:
            self._forget_rounds(g)
            g.freeze = GroupFreeze(
                group=group,
                generation=cur.generation + 1,
                job=req.job,
                reason=req.reason,
                mode=req.mode,
                opened_at=time.time(),
                joined=[req.job],
            )
            g.opened = now
            log.info(
                "NCCL group freeze opened",
                extra={"group": group, "generation": g.freeze.generation, "job": req.job,
                       "mode": req.mode, "reason": req.reason},
            )  # fmt: skip
        g.wake()
        return g.freeze.model_copy(deep=True)

    async def watch(self, group: str, after: int, wait_s: float) -> GroupFreeze:
        """The group's newest generation, at once when it is past ``after``, else once one
        opens or after ``wait_s`` seconds (clamped to [0, :data:`MAX_WAIT_S`])."""
        g = self._group(group)
        await self._wait(g, wait_s, lambda: g.freeze.generation > after)
        return g.freeze.model_copy(deep=True)

    # ----- rounds -------------------------------------------------------------------------

    def put(self, group: str, round: str, entry: RoundEntry) -> Round:
        """Keep ``entry`` in ``round`` of the group's current generation (replacing the
        entry its job put there before) and answer the round."""
        g = self._group(group)
        entries = g.rounds.get(round)
        if entries is None and len(g.rounds) >= MAX_ROUNDS:
            raise ControllerRefused(
                f"group {group!r}: generation {g.freeze.generation} has {MAX_ROUNDS} rounds already"
            )
        entries = entries if entries is not None else {}
        if entry.job not in entries and len(entries) >= MAX_ENTRIES:
            raise ControllerRefused(
                f"group {group!r}: round {round!r} has {MAX_ENTRIES} entries already"
            )
        size = len(entry.model_dump_json())
        old = entries[entry.job][1] if entry.job in entries else 0
        if self.nbytes - old + size > MAX_BYTES:
            raise ControllerRefused(
                f"the controller holds {MAX_BYTES} bytes of round entries already; "
                f"refused {size} more for group {group!r}"
            )
        entries[entry.job] = (entry, size)
        g.rounds[round] = entries
        self.nbytes += size - old
        g.wake()
        return g.round(round)

    async def get(self, group: str, round: str, have: int, wait_s: float) -> Round:
        """``round`` of the group's current generation once it holds more than ``have``
        entries, or once another generation opens, or after ``wait_s`` seconds (clamped):
        then with what it holds (maybe nothing)."""
        g = self._group(group)
        start = g.freeze.generation

        def ready() -> bool:
            return g.freeze.generation != start or len(g.rounds.get(round, {})) > have

        await self._wait(g, wait_s, ready)
        return g.round(round)

    # ----- plumbing -----------------------------------------------------------------------

    async def _wait(self, g: _Group, wait_s: float, ready: Callable[[], bool]) -> None:
        """Until ``ready()`` or ``wait_s`` (clamped) seconds have passed."""
        loop = asyncio.get_running_loop()
        end = loop.time() + clamp_wait(wait_s)
        g.waiting += 1
        try:
            while not self.closed and not ready():
                left = end - loop.time()
                if left <= 0:
                    return
                try:
                    await asyncio.wait_for(g.changed.wait(), left)
                except TimeoutError:
                    return
        finally:
            g.waiting -= 1
            g.seen = self.clock()

    def _group(self, name: str) -> _Group:
        """The group ``name`` (made on first use; idle ones dropped to make room past
        :data:`MAX_GROUPS`, else :class:`ControllerRefused`)."""
        now = self.clock()
        g = self.groups.get(name)
        if g is None:
            if len(self.groups) >= MAX_GROUPS:
                self._drop_idle(now)
            if len(self.groups) >= MAX_GROUPS:
                raise ControllerRefused(
                    f"the controller holds {MAX_GROUPS} NCCL groups already; group {name!r} refused"
                )
            g = self.groups[name] = _Group(GroupFreeze(group=name))
        g.seen = now
        return g

    def _drop_idle(self, now: float) -> None:
        for name, g in list(self.groups.items()):
            if g.waiting == 0 and now - g.seen > IDLE_S:
                self._forget_rounds(g)
                del self.groups[name]
                log.info("NCCL group dropped: idle for a day", extra={"group": name})

    def _forget_rounds(self, g: _Group) -> None:
        self.nbytes -= sum(size for r in g.rounds.values() for _e, size in r.values())
        g.rounds.clear()
