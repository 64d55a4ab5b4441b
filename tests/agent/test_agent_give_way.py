"""Which checkpoint a protected job's worker runs first when a notice's exit meets a
leave-running checkpoint (:class:`~spotguard.agent.worker.JobWorker`): a due exit goes before
a due periodic one, and a leave-running checkpoint under way gives way to an exit only when
``gives_way`` (the daemon's deadline planner, :func:`spotguard.operations.exit_fits`) says
the exit fits alone — never an exit under way. The checkpoints here are the worker's
callable, recording what ran; the real freeze, cancelled in its upload by a real agent, is in
``test_agent_notice_first.py``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import Host, job_argv

from spotguard import operations
from spotguard.agent.metrics import AgentMetrics
from spotguard.agent.reporter import Reporter
from spotguard.agent.worker import JobWorker, Request
from spotguard.checkpoint.jobs import start_job
from spotguard.contracts import Mode
from spotguard.errors import CheckpointError
from spotguard.notices.base import Cloud, Notice, NoticeKind


class Runs:
    """The worker's checkpoints: each records ``(mode, "start"|"end"|"cancelled")``; one of
    a mode in ``blocks`` lasts until ``release`` is set (an upload that takes long); every one
    ends with a non-retryable error (no image: what the worker does next is under test)."""

    def __init__(self, blocks: tuple[Mode, ...] = (Mode.RESUME,)) -> None:
        self.blocks = blocks
        self.log: list[tuple[str, str]] = []
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    async def __call__(self, mode: Mode, deadline: Any, meta: Any, on_frozen: Any) -> Any:
        self.log.append((mode.value, "start"))
        self.started.set()
        try:
            if mode in self.blocks:
                await self.release.wait()
        except asyncio.CancelledError:
            self.log.append((mode.value, "cancelled"))
            raise
        self.log.append((mode.value, "end"))
        raise CheckpointError("no image in this test")


def _worker(tmp_path: Path, runs: Runs, answer: bool | None, **kw: Any) -> JobWorker:
    metrics = AgentMetrics()
    reporter = Reporter(None, None, tmp_path / "outbox", metrics=metrics)
    asked: list[datetime] = []

    async def gives_way(deadline: datetime) -> bool:
        asked.append(deadline)
        assert answer is not None
        return answer

    w = JobWorker("train", os.getpid(), runs, reporter=reporter, metrics=metrics, instance={},
                  gives_way=None if answer is None else gives_way, **kw)  # fmt: skip
    w.asked = asked  # type: ignore[attr-defined]
    return w


def _request(key: str, mode: Mode) -> tuple[Request, asyncio.Future[Any]]:
    now = datetime.now(UTC)
    notice = Notice(key, Cloud.AWS, NoticeKind.PREEMPT, now + timedelta(seconds=120), "stop")
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    return Request(key, mode, now, "test", notice=notice, waiters=[done]), done


@contextlib.asynccontextmanager
async def _running(w: JobWorker, runs: Runs, key: str, mode: Mode) -> AsyncIterator[Any]:
    """``w`` running, its first checkpoint (``key``, ``mode``) started; yields its waiter."""
    first, done = _request(key, mode)
    w.submit(first)
    loop = asyncio.create_task(w.run())
    try:
        await asyncio.wait_for(runs.started.wait(), 10)
        yield done
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def _until(cond: Any, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_due_exit_goes_before_a_due_periodic_checkpoint(tmp_path: Path) -> None:
    """The periodic checkpoint was due before the notice came: the exit still goes first (an
    image taken before it would be superseded at once)."""
    runs = Runs()
    w = _worker(tmp_path, runs, None, periodic_interval=60.0,
                last_image_at=datetime.now(UTC).timestamp() - 120)  # fmt: skip
    exit_req, _ = _request("aws-preempt", Mode.EXIT)
    exit_req.start_at = datetime.now(UTC) - timedelta(seconds=1)
    w.submit(exit_req)
    chosen = w._next()
    assert chosen is not None and chosen.key == "aws-preempt"


@pytest.mark.parametrize("answer", [True, False], ids=["fits-alone", "does-not-fit"])
async def test_a_leave_running_checkpoint_gives_way_to_an_exit_only_when_the_exit_fits(
    tmp_path: Path, answer: bool
) -> None:
    runs = Runs()
    w = _worker(tmp_path, runs, answer)
    async with _running(w, runs, "aws-rebalance", Mode.RESUME) as rebalance_done:
        exit_req, exit_done = _request("aws-preempt", Mode.EXIT)
        w.submit(exit_req)
        await _until(lambda: w.asked, "the worker asking")  # type: ignore[attr-defined]
        if answer:
            await _until(lambda: ("exit", "start") in runs.log, "the exit starting")
            assert runs.log[:3] == [("resume", "start"), ("resume", "cancelled"), ("exit", "start")]
            assert (await asyncio.wait_for(rebalance_done, 5))["gave_way_to"] == "aws-preempt"
        else:
            await asyncio.sleep(0.3)
            assert runs.log == [("resume", "start")], "the running checkpoint was given up"
            runs.release.set()
            await _until(lambda: ("exit", "start") in runs.log, "the exit starting")
            assert runs.log[:3] == [("resume", "start"), ("resume", "end"), ("exit", "start")]
        assert "error" in await asyncio.wait_for(exit_done, 5)


async def test_an_exit_under_way_never_gives_way_and_nothing_is_asked(tmp_path: Path) -> None:
    runs = Runs(blocks=(Mode.EXIT,))
    w = _worker(tmp_path, runs, True)
    async with _running(w, runs, "aws-maintenance", Mode.EXIT) as first_done:
        second, _ = _request("aws-preempt", Mode.EXIT)
        w.submit(second)
        await asyncio.sleep(0.3)
        assert w.asked == [] and runs.log == [("exit", "start")]  # type: ignore[attr-defined]
        runs.release.set()
        assert "error" in await asyncio.wait_for(first_done, 5)


async def test_the_workers_own_cancellation_cancels_the_checkpoint_under_way(
    tmp_path: Path,
) -> None:
    """Stopping the worker (the agent stopping) still ends the checkpoint under way and the
    worker with it: the give-way path does not swallow it."""
    runs = Runs()
    w = _worker(tmp_path, runs, True)
    rebalance, _ = _request("aws-rebalance", Mode.RESUME)
    w.submit(rebalance)
    loop = asyncio.create_task(w.run())
    await asyncio.wait_for(runs.started.wait(), 10)
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(loop, 5)
    assert runs.log == [("resume", "start"), ("resume", "cancelled")]


@pytest.mark.criu
async def test_exit_fits_asks_the_deadline_planner_about_the_job(host: Host) -> None:
    """The daemon's ``gives_way``: a real job, the planner's prediction for its exit against
    a deadline two minutes away (fits) and one already at hand (does not)."""
    job = await start_job(job_argv("--steps", "2000", "--mb", "16", "--gpu", "no"), "train",
                          state_dir=host.state)  # fmt: skip
    try:
        settings, store = host.checkpoint_settings(), f"file://{host.state}/store"
        now = datetime.now(UTC)

        async def fits(deadline: datetime) -> bool:
            return await operations.exit_fits(
                job, store, settings=settings, planner_settings=None, deadline=deadline
            )

        assert (await fits(now + timedelta(minutes=2)), await fits(now)) == (True, False)
    finally:
        os.kill(job.pid, signal.SIGKILL)
