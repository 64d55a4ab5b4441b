"""Every agent step that ends a job's process is journaled before it acts (the intent), then
its outcome, in the agent's ledger (:mod:`spotguard.agent.ledger`): a restart at any instant
finds out what happened instead of guessing.

* :func:`checkpointing` — around an agent checkpoint: an exit checkpoint writes ``exiting``
  before the engine may stop the job; then ``exited`` (image durable), ``pushing`` (image
  kept on the host) or, when the checkpoint failed and the job runs on, ``protecting``.
* :func:`report_unrecorded_exit` — at protect time: a dead job that this agent's exit
  checkpoint stopped while the outcome was never recorded (killed the instant CRIU stopped
  the job) is reported with its image (``durable`` + ``exited``), so the controller
  relaunches it, never as finished by itself.

Assignment restores journal the same way (``restoring`` before CRIU, then ``restored``;
:mod:`spotguard.agent.restore`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from spotguard import operations
from spotguard.checkpoint.jobs import JobInfo
from spotguard.contracts import DurableEvent, ExitedEvent, InstanceInfo, Mode
from spotguard.image import ImageSettings

from .jobstate import JobState
from .ledger import Ledger, exit_unrecorded, stopped_by_us
from .reporter import Reporter


@contextmanager
def checkpointing(
    ledger: Ledger, info: JobInfo, mode: Mode, alive: Callable[[], bool]
) -> Iterator[Callable[[operations.CheckpointResult], None]]:
    """Journal one checkpoint of ``info``: the intent now, the outcome when the block ends
    (call the yielded function with the result on success). ``alive``: whether the job's
    own process runs (by identity)."""
    if mode is Mode.EXIT:
        ledger.put(info.name, info.pid, JobState.EXITING)

    def done(result: operations.CheckpointResult) -> None:
        state = JobState.EXITED if result.mode is Mode.EXIT else JobState.PROTECTING
        ledger.put(
            info.name, info.pid, state, image_url=result.image_url, image_at=result.frozen_at
        )

    try:
        yield done
    except operations.ImageKept:
        ledger.put(info.name, info.pid, JobState.PUSHING)  # stopped; its image waits for the store
        raise
    except BaseException:
        if mode is Mode.EXIT and alive():
            ledger.put(info.name, info.pid, JobState.PROTECTING)  # the engine brought it back
        raise


async def ended_by_us(
    info: JobInfo,
    *,
    ledger: Ledger,
    store: str,
    instance: dict[str, Any],
    settings: ImageSettings,
    reporter: Reporter,
    alive: bool,
) -> bool:
    """Whether ``info`` is a dead job this agent's exit checkpoint stopped: recorded
    (:func:`~spotguard.agent.ledger.stopped_by_us`) or not (:func:`report_unrecorded_exit`).
    ``alive``: whether the job's own process runs (by identity, not by pid alone)."""
    if stopped_by_us(ledger, info, alive):
        return True
    return await report_unrecorded_exit(
        info, ledger=ledger, store=store, instance=instance, settings=settings,
        reporter=reporter, alive=alive,
    )  # fmt: skip


async def report_unrecorded_exit(
    info: JobInfo,
    *,
    ledger: Ledger,
    store: str,
    instance: dict[str, Any],
    settings: ImageSettings,
    reporter: Reporter,
    alive: bool,
) -> bool:
    """Whether ``info`` was stopped by an exit checkpoint whose outcome was never recorded;
    if so, record it and report its image (see the module doc). ``alive``: whether the
    job's own process runs (by identity)."""
    where = InstanceInfo.model_validate(instance)
    found = await exit_unrecorded(ledger, info, store, where.instance_id, settings, alive)
    if found is None:
        return False
    url, frozen_at = found
    ledger.put(info.name, info.pid, JobState.EXITED, image_url=url, image_at=frozen_at)
    if url is not None:
        reporter.emit(DurableEvent(job=info.name, instance=where, image_url=url, mode=Mode.EXIT))
    reporter.emit(ExitedEvent(job=info.name, instance=where, image_url=url))
    return True
