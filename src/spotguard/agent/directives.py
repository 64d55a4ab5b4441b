"""Poll the controller for what it wants from each protected job (``GET …/directive``).

The controller answers every agent event with an ``action``; a job with nothing to report
(no notice, no periodic checkpoint) would never hear it. So the agent asks, every
``directive_poll_s`` seconds, ``GET {controller}/v1/jobs/{job}/directive`` for each job it
protects (with ``?epoch=N`` when an assignment gave the job to this agent under epoch N: an
agent holding the fleet token is then told, too, when it no longer owns the job) and hands
the answer (a :class:`~spotguard.contracts.Directive`: ``action``, ``reason``, ``state``,
``target``, ``owner``, ``stand_down``) to the same handler as event answers. A poll is only
a question: a 404 (the controller has not seen the job yet), a refusal or an unreachable
controller is logged at debug level and asked again next round; the reporter's own retries
surface real outages. The questions go through the one controller client
(:class:`~spotguard.controller.client.ControllerClient`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from spotguard.contracts import Directive
from spotguard.controller.client import ControllerClient
from spotguard.errors import SpotguardError

log = logging.getLogger(__name__)


class DirectivePoller:
    """Asks the controller at ``controller_url`` about each job from ``jobs()`` every
    ``interval_s`` seconds and passes each answer to ``on_answer``."""

    def __init__(
        self,
        controller_url: str,
        token: str | None,
        jobs: Callable[[], Iterable[str]],
        on_answer: Callable[[Directive], None],
        *,
        interval_s: float,
        timeout_s: float = 5.0,
        epoch_of: Callable[[str], int | None] | None = None,
    ) -> None:
        self.client = ControllerClient(controller_url, token, timeout_s=timeout_s)
        self.jobs = jobs
        self.on_answer = on_answer
        self.interval_s = interval_s
        self.polls = 0
        self.epoch_of = epoch_of  # the ownership epoch this agent holds a job under, if known

    @classmethod
    def start(
        cls,
        url: str | None,
        token: str | None,
        interval_s: float,
        jobs: Callable[[], Iterable[str]],
        on_answer: Callable[[Directive], None],
        epoch_of: Callable[[str], int | None],
        spawn: Callable[[Coroutine[Any, Any, None], str], object],
    ) -> DirectivePoller | None:
        """A poller of ``url`` every ``interval_s`` seconds, started with ``spawn``; None
        (nothing started) without a controller or with an interval of 0."""
        if not url or interval_s <= 0:
            return None
        poller = cls(url, token, jobs, on_answer, interval_s=interval_s, epoch_of=epoch_of)
        spawn(poller.run(), "directives")
        return poller

    async def run(self) -> None:
        """Poll until cancelled."""
        async with self.client:
            while True:
                await asyncio.sleep(self.interval_s)
                for job in list(self.jobs()):
                    answer = await self.ask(job)
                    if answer is not None:
                        self.on_answer(answer)

    async def ask(self, job: str) -> Directive | None:
        """The controller's directive for ``job``; None when it has none to give now."""
        epoch = self.epoch_of(job) if self.epoch_of is not None else None
        self.polls += 1
        try:
            return await self.client.directive(job, epoch)
        except SpotguardError as exc:
            log.debug("no directive", extra={"step": "directive", "job": job, "error": str(exc)})
            return None
