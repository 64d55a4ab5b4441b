"""The agent's side of park: run the park policies for the jobs it protects, never touch a job
it is checkpointing or has a notice pending for, and tell parked jobs from finished ones.

A job parked as an image (tmpfs, disk, store) has no process: its worker is set aside as
``parked`` (no ``job_finished`` is reported) and the agent protects it again when it runs
under its new pid. A job suspended in place keeps its process and stays protected: a notice
checkpoints it like any other (the engine knows what a suspended job needs).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard import operations
from spotguard.checkpoint.jobs import JobInfo, resolve_job
from spotguard.errors import SpotguardError
from spotguard.park import record, waker
from spotguard.park.policy import ParkPolicy, webhooks
from spotguard.park.store import store_path

from .worker import JobWorker

if TYPE_CHECKING:
    from .daemon import Agent


def is_parked(state_dir: Path, job: str) -> bool:
    """True while the job has a park record (its state is kept, it did not finish)."""
    try:
        return record.load(state_dir, job) is not None
    except Exception:  # noqa: BLE001 - an unreadable record still means "do not call it done"
        return True


def gone(worker: JobWorker, state_dir: Path) -> None:
    """The job's process is gone: parked as an image (kept; protected again when it runs) or
    finished by itself."""
    if is_parked(state_dir, worker.name):
        worker.parked()
    else:
        worker.job_ended()


def parked_status(state_dir: Path) -> list[dict[str, Any]]:
    """The parked jobs of this node as ``status`` shows them: where, since when, why."""
    out = []
    for rec in record.all_records(state_dir):
        out.append(
            {
                "job": rec.job,
                "place": rec.place,
                "where": rec.location,
                "since": rec.since.isoformat(),
                "reason": rec.reason,
                "bytes": rec.bytes,
                "gpu_memory_freed": rec.gpu_bytes_freed,
                "wake_on_connect": rec.wake_on_connect,
            }
        )
    return out


def policy_for(agent: Agent) -> ParkPolicy:
    """The park policy over the agent's workers: busy while checkpointing or with a notice
    pending; webhooks told; wake-on-connect listeners started with the agent's config."""
    checkpoint, workers = agent.checkpoint_settings, agent.workers
    agent.metrics.count_parked(checkpoint.state_dir)
    engine = operations.engine_for(checkpoint)

    def busy(job: str) -> bool:
        w = workers.get(job)
        return w is None or w.state != "protecting" or bool(w.pending)

    async def start_waker(job: str) -> None:
        await asyncio.to_thread(waker.spawn, checkpoint.state_dir, job, agent.config)

    def jobs() -> list[JobInfo]:
        out = []
        for w in list(workers.values()):
            if w.active:
                with contextlib.suppress(SpotguardError):
                    out.append(resolve_job(w.name, state_dir=checkpoint.state_dir))
        return out

    policy = ParkPolicy(
        settings=agent.park_settings,
        checkpoint=checkpoint,
        engine=engine,
        jobs=jobs,
        busy=busy,
        start_waker=start_waker,
        store=store_path(checkpoint, agent.image_settings, engine),
    )
    if agent.notifier is not None:
        policy.notify = webhooks(agent.notifier)
    return policy
