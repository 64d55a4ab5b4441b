"""The agent's park policies, run every ``[park] sample_every`` seconds:

* **idle**: a protected job idle (GPU, CPU and network, see :mod:`.idle`) for
  ``[park] idle_after`` seconds is parked to ``[park] to`` (waking on connect when it had
  listening ports and ``[park] wake_on_connect`` is on), and the webhooks say so;
* **priority**: jobs parked to make room for a higher-priority job come back, highest
  priority first, once the GPU memory they need is free again (:mod:`.priority`).

A job that is being checkpointed or has a notice pending is never parked (the agent says
which through ``busy``). Everything the policy does goes through the
:class:`~.service.ParkService` (over :func:`.core.park` and :func:`.core.unpark`), so their
guarantees hold: a failed park leaves the job running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo
from spotguard.errors import SpotguardError

from . import core, priority, record
from .idle import IdleTracker
from .record import ParkRecord
from .service import ParkService
from .settings import ParkSettings

log = logging.getLogger(__name__)


@dataclass
class ParkPolicy:
    """Idle parking and priority unparking for the jobs an agent protects; the parks and
    unparks go through the ``service`` (the same one ``spotguard park`` uses)."""

    service: ParkService
    jobs: Callable[[], Sequence[JobInfo]]
    busy: Callable[[str], bool] = lambda _job: False
    trackers: dict[str, IdleTracker] = field(default_factory=dict)

    @property
    def settings(self) -> ParkSettings:
        return self.service.settings

    def running(self) -> list[JobInfo]:
        """Protected jobs that run now (not parked, process alive)."""
        state = self.service.checkpoint.state_dir
        return [
            j for j in self.jobs() if record.load(state, j.name) is None and proctree.alive(j.pid)
        ]

    async def park(self, job: JobInfo, reason: str, *, wake: bool) -> ParkRecord:
        claim = priority.read_claim(job.dir)
        done = await self.service.park(job, reason, wake=wake, priority=claim.priority)
        return done.record

    async def unpark(self, job: str) -> core.Unparked:
        return await self.service.unpark(job)

    async def park_idle(self) -> list[str]:
        """Park every running job idle for ``idle_after`` seconds; the names parked."""
        if self.settings.idle_after <= 0:
            return []
        parked = []
        running = self.running()
        names = {j.name for j in running}
        for gone in set(self.trackers) - names:
            del self.trackers[gone]
        for job in running:
            tracker = self.trackers.setdefault(job.name, IdleTracker(self.settings))
            await asyncio.to_thread(tracker.observe, job.pid)
            if not tracker.is_idle() or self.busy(job.name):
                continue
            reason = (
                f"idle for {tracker.idle_seconds():.0f} s (GPU <= "
                f"{self.settings.idle_gpu_percent:g}%, CPU <= {self.settings.idle_cpu_percent:g}%"
                f", network <= {self.settings.idle_bytes} B)"
            )
            try:
                await self.park(job, reason, wake=self.settings.wake_on_connect)
            except SpotguardError as exc:
                log.warning("idle job not parked", extra={"job": job.name, "error": str(exc)})
                await self.service.notify("park_failed", {"job": job.name, "error": str(exc)})
                continue
            del self.trackers[job.name]
            parked.append(job.name)
        return parked

    async def make_room(self, need: priority.Claim, for_job: str) -> list[str]:
        """Park lower-priority jobs so that ``need`` fits (see :func:`.priority.make_room`)."""
        cap = priority.capacity_bytes(self.settings.gpu_capacity_mib)

        async def park(job: JobInfo, why: str) -> ParkRecord:
            return await self.park(job, why, wake=False)

        return await priority.make_room(need, self.running(), cap, park, for_job=for_job)

    async def bring_back(self) -> list[str]:
        cap = priority.capacity_bytes(self.settings.gpu_capacity_mib)
        return await priority.bring_back(
            self.service.checkpoint.state_dir, self.running(), cap, self.unpark
        )

    async def tick(self) -> None:
        """One round of both policies; a failure is logged, never raised."""
        try:
            await self.park_idle()
            await self.bring_back()
        except SpotguardError as exc:
            log.warning("park policy round failed", extra={"error": str(exc)})

    async def run(self, stop: asyncio.Event) -> None:
        """Run :meth:`tick` every ``sample_every`` seconds until ``stop`` is set."""
        while not stop.is_set():
            await self.tick()
            try:
                await asyncio.wait_for(stop.wait(), self.settings.sample_every)
            except TimeoutError:
                continue
