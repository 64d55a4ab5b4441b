"""A leave-running checkpoint under way giving way to a notice's exit.

A job's worker (:mod:`.worker`) runs one checkpoint at a time. A leave-running one — periodic,
or what AWS's rebalance recommendation asks for by default — lets the job run again once its
image is in host memory, and may then upload for a long time (a large job, a slow store). An
interruption notice arriving meanwhile would wait behind that upload and lose part of its two
minutes. So its exit is weighed against the deadline (``GivesWay``: the daemon asks the
deadline planner, :func:`spotguard.operations.exit_fits`): when the exit alone is predicted
to fit, the running checkpoint is cancelled — no manifest is written, and the engine brings
the job back as from any cancelled freeze — and the exit runs at once; when it does not fit,
the image under way is the best to be had and the exit waits for it, as before. An exit under
way never gives way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Protocol

from spotguard.modes import Mode

log = logging.getLogger(__name__)

#: whether a leave-running checkpoint under way gives way to a notice's exit due before
#: ``deadline`` (the daemon: whether the deadline planner predicts the exit alone to fit)
GivesWay = Callable[[datetime], Awaitable[bool]]


class Request(Protocol):
    """What is weighed of a queued checkpoint (:class:`.worker.Request`)."""

    key: str
    mode: Mode

    @property
    def deadline(self) -> datetime | None: ...


class GiveWay:
    """One worker's checkpoint under way (``running``, set by the worker) and whether it was
    cancelled for a notice (``gave_way_to``). ``ask`` None: a notice always waits."""

    def __init__(self, job: str, ask: GivesWay | None) -> None:
        self.job = job
        self.ask = ask
        self.running: tuple[Request, asyncio.Task[None]] | None = None
        self.gave_way_to: str | None = None
        self._asking: set[asyncio.Task[None]] = set()

    def done(self) -> None:
        """The checkpoint under way ended (whichever way)."""
        self.running = None
        self.gave_way_to = None

    def consider(self, req: Request, pending: Mapping[str, Request]) -> None:
        """``req`` was just queued: if it is a notice's exit and a leave-running checkpoint
        runs, weigh them (in a task: the planner reads the job's memory map)."""
        running = self.running
        if (
            self.ask is None
            or running is None
            or running[0].mode is not Mode.RESUME
            or req.mode is not Mode.EXIT
            or req.deadline is None
            or self.gave_way_to is not None
        ):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # queued from outside the agent's loop: the notice waits
            return
        task = loop.create_task(self._weigh(req, req.deadline, running, pending))
        self._asking.add(task)
        task.add_done_callback(self._asking.discard)

    async def _weigh(
        self,
        req: Request,
        deadline: datetime,
        running: tuple[Request, asyncio.Task[None]],
        pending: Mapping[str, Request],
    ) -> None:
        assert self.ask is not None
        try:
            go = await self.ask(deadline)
        except Exception as exc:  # noqa: BLE001 - a look ahead only: the notice waits as before
            log.warning(
                "could not weigh a notice against the checkpoint under way",
                extra={"job": self.job, "notice": req.key, "error": str(exc)},
            )
            return
        current, task = running
        if not go or self.running is not running or task.done() or req.key not in pending:
            return  # not to fit, or the one under way ended, or the notice was cancelled
        if self.gave_way_to is not None:
            return
        self.gave_way_to = req.key
        log.warning(
            "a leave-running checkpoint under way gave way to a notice's exit",
            extra={"step": "checkpoint", "job": self.job, "notice": current.key,
                   "reason": f"notice {req.key} predicted to fit its deadline alone"},
        )  # fmt: skip
        task.cancel()
