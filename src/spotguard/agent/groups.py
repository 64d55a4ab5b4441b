"""The agent's side of NCCL groups (jobs whose ranks span VMs; :mod:`spotguard.groupwire`).

* :class:`ControllerPeers` — the meeting point the engine's NCCL step uses
  (:class:`spotguard.checkpoint.ncclgroup.Peers`), over the controller's group routes: opening
  or joining a freeze generation, and rounds posted and waited for by long polls.
* :class:`GroupWatch` — for each protected job started with ``--nccl-group``, a long poll of
  the group's freeze generations: when another member opens one (its VM got a notice, or it
  checkpoints periodically), this job is checkpointed too, in the same mode (``exit``: the
  agent drains, as for a notice; ``resume``: one checkpoint of the job, left running). A
  generation this job already joined, or one opened before the watch started, is not acted on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from datetime import UTC, datetime
from typing import Any

from spotguard.checkpoint.ncclgroup import PeersFactory
from spotguard.checkpoint.procfacts import read_environ
from spotguard.controller.client import ControllerClient
from spotguard.errors import NcclError, SpotguardError
from spotguard.groupwire import GROUP_ENV, FreezeRequest, GroupFreeze, RoundEntry
from spotguard.modes import Mode

from .jobstate import JobState
from .worker import JobWorker, Request

log = logging.getLogger(__name__)

#: longest single long poll (the controller clamps it to 30 s)
POLL_S = 25.0


class ControllerPeers:
    """Job ``job``'s meeting point with the rest of group ``group``, through ``client``."""

    def __init__(self, client: ControllerClient, group: str, job: str) -> None:
        self.client = client
        self.group = group
        self.job = job
        self.generation: int | None = None  # the generation begin() joined or opened

    async def begin(self, mode: str, reason: str) -> int:
        """Open or join a freeze generation of the group (:class:`NcclError` if the
        controller cannot be asked: the freeze then fails and the job runs on)."""
        try:
            req = FreezeRequest.model_validate({"job": self.job, "reason": reason, "mode": mode})
            opened = await self.client.group_freeze(self.group, req)
        except SpotguardError as exc:
            raise NcclError(f"NCCL group {self.group!r}: {exc}") from exc
        self.generation = opened.generation
        if opened.mode == "exit" and mode == "resume":
            raise NcclError(
                f"NCCL group {self.group!r}: generation {opened.generation} stops every member "
                f"(exit, opened by {opened.job}): this resume checkpoint gives way to it"
            )
        log.info(
            "NCCL group freeze",
            extra={
                "job": self.job,
                "group": self.group,
                "generation": opened.generation,
                "opened_by": opened.job,
                "mode": mode,
            },
        )
        return opened.generation

    async def exchange(
        self,
        name: str,
        entry: RoundEntry,
        complete: Callable[[list[RoundEntry]], bool],
        wait_s: float,
    ) -> list[RoundEntry]:
        """Post ``entry`` in round ``name`` and wait until ``complete`` holds (in a
        generation :meth:`begin` did not name, the round of whichever is current)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        try:
            got = await self.client.put_round(self.group, name, entry)
            while not complete(got.entries):
                self._current(got.generation, name)
                left = deadline - loop.time()
                if left <= 0:
                    jobs = ", ".join(sorted(e.job for e in got.entries)) or "none"
                    raise NcclError(
                        f"NCCL group {self.group!r}: round {name} did not fill in {wait_s:.0f} "
                        f"s (jobs there: {jobs}): a member's agent did not come"
                    )
                if not any(e.job == entry.job for e in got.entries):
                    # a newer generation opened (the others restored elsewhere): its round is
                    # new, so this job's entry is put there again (a rebuild meets them there)
                    got = await self.client.put_round(self.group, name, entry)
                    continue
                have = len(got.entries)
                got = await self.client.get_round(self.group, name, have, min(left, POLL_S))
        except NcclError:
            raise
        except SpotguardError as exc:
            raise NcclError(f"NCCL group {self.group!r}: {exc}") from exc
        self._current(got.generation, name)
        return got.entries

    def _current(self, generation: int, name: str) -> None:
        """Fail fast once another member opened a newer generation: this one's rounds are
        forgotten at the controller and its members follow the newer one."""
        if self.generation is not None and generation != self.generation:
            raise NcclError(
                f"NCCL group {self.group!r}: round {name} of generation {self.generation} was "
                f"superseded by generation {generation}; this freeze gives way"
            )


#: what the watch does for a generation another member opened: (job, generation) → None
OnFreeze = Callable[[str, GroupFreeze], None]


class GroupWatch:
    """Watches group ``group`` for job ``job`` and calls ``on_freeze`` for each new
    generation another member opened (not of mode ``restore``)."""

    def __init__(self, client: ControllerClient, group: str, job: str, on_freeze: OnFreeze) -> None:
        self.client = client
        self.group = group
        self.job = job
        self.on_freeze = on_freeze
        self.seen: int | None = None

    async def run(self) -> None:
        """Long-poll until cancelled; an unreachable controller is asked again later."""
        while True:
            try:
                if self.seen is None:
                    self.seen = (await self.client.watch_group(self.group, 0, 0)).generation
                    log.info(
                        "watching NCCL group",
                        extra={"job": self.job, "group": self.group, "generation": self.seen},
                    )
                got = await self.client.watch_group(self.group, self.seen, POLL_S)
            except SpotguardError as exc:  # a refusal is a bug worth seeing; an outage is not
                level = logging.DEBUG if exc.retryable else logging.WARNING
                log.log(level, "NCCL group watch failed; asking again", extra={
                    "job": self.job, "group": self.group, "error": str(exc)})  # fmt: skip
                await asyncio.sleep(2.0)
                continue
            if got.generation <= self.seen:
                continue
            self.seen = got.generation
            if got.mode == "restore" or (got.mode == "resume" and self.job in got.joined):
                continue  # an exit is always followed: a resume of this job may have given way
            log.info(
                "another member of the NCCL group freezes: this job too",
                extra={
                    "job": self.job,
                    "group": self.group,
                    "generation": got.generation,
                    "opened_by": got.job,
                    "mode": got.mode,
                    "reason": got.reason,
                },
            )
            self.on_freeze(self.job, got)


def group_of_pid(pid: int) -> str | None:
    """The NCCL group job process ``pid`` was started in (``spotguard run --nccl-group``)."""
    return read_environ(pid).get(GROUP_ENV) or None


def peers_factory(controller: Callable[[], tuple[str | None, str | None]]) -> PeersFactory:
    """The engine's meeting points: one :class:`ControllerPeers` per (group, job) over the
    controller ``controller()`` names when asked (url, token); none without a controller
    (a group's spanning communicators are then refused by name)."""

    def make(group: str, job: str) -> ControllerPeers | None:
        url, token = controller()
        if not url:
            return None
        return ControllerPeers(ControllerClient(url, token), group, job)

    return make


def watch(
    pid: int,
    job: str,
    controller: tuple[str | None, str | None],
    on_freeze: OnFreeze,
) -> Coroutine[Any, Any, None] | None:
    """The group watch of job ``job`` (root process ``pid``), or None when it has no group
    or this agent no controller."""
    group = group_of_pid(pid)
    url, token = controller
    if group is None or not url:
        return None
    return GroupWatch(ControllerClient(url, token), group, job, on_freeze).run()


def freeze_handler(drain: Callable[[str], object], workers: Mapping[str, JobWorker]) -> OnFreeze:
    """What the agent does when another member of a job's group freezes: ``exit``, drain
    (as for a notice: the controller relaunches the job from its image); ``resume``, one
    checkpoint of the job, left running."""

    def on_freeze(job: str, opened: GroupFreeze) -> None:
        why = f"NCCL group {opened.group}: {opened.job or 'a member'} freezes ({opened.reason})"
        if opened.mode == "exit":
            drain(why)  # also when this job's own exit runs now: the drain then finds it gone
        elif (w := workers.get(job)) is not None and w.state is not JobState.CHECKPOINTING:
            key = f"group-{opened.group}-{opened.generation}"
            w.submit(Request(key, Mode.RESUME, datetime.now(UTC), why))

    return on_freeze
