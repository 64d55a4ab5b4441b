"""Jobs started with ``spotguard run`` are protected by the running agent without a config
edit: the agent looks at ``<state_dir>/jobs/`` every few seconds and guards each live job it
does not guard yet, unless the job was started with ``spotguard run --no-protect`` (a
``no-protect`` file in its directory, written by ``start_job`` before the job can be
found).

``spotguard run`` asks the agent (:func:`protector`) so that it can say which agent protects
the new job, or that none runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import NO_PROTECT, JobInfo, list_jobs

log = logging.getLogger(__name__)


def opted_out(job: JobInfo) -> bool:
    return (job.dir / NO_PROTECT).exists()


def candidates(state_dir: Path, taken: Iterable[str]) -> list[JobInfo]:
    """Live jobs of ``state_dir`` that nobody guards yet and that did not opt out."""
    seen = set(taken)
    return [
        job
        for job in list_jobs(state_dir)
        if job.name not in seen and not opted_out(job) and proctree.alive(job.pid)
    ]


async def watch(
    state_dir: Path,
    taken: Callable[[], Iterable[str]],
    protect: Callable[[str], Any],
    interval_s: float,
) -> None:
    """Forever: guard (``protect(name)``) each new job ``spotguard run`` started."""
    while True:
        for job in await asyncio.to_thread(candidates, state_dir, list(taken())):
            log.info(
                "protecting a job started by spotguard run",
                extra={"step": "job", "job": job.name, "pid": job.pid},
            )
            protect(job.name)
        await asyncio.sleep(interval_s)


def protector(status: dict[str, Any] | None, *, opted: bool) -> str:
    """What ``spotguard run`` says about the new job's protection, from the local agent's
    status answer (None: no agent answered)."""
    if opted:
        return "not protected (--no-protect): no agent checkpoints it"
    if status is None:
        return (
            "not protected: no spotguard agent is running on this host "
            "(start one: systemctl enable --now spotguard-agent)"
        )
    agent = status.get("agent", {})
    if not agent.get("discover", False):
        return (
            f"not protected yet: the agent (pid {agent.get('pid')}) protects only the jobs its "
            "config names (discover_jobs is off): add it to [agent] job"
        )
    return (
        f"protected by the agent (pid {agent.get('pid')}, store {agent.get('store')}) "
        "within seconds: see spotguard status"
    )
