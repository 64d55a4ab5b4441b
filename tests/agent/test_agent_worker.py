"""One protected job's worker on its own (:class:`~spotguard.agent.worker.JobWorker`): a real
job, real CRIU checkpoints into a ``file://`` store through the one checkpoint composition
(:func:`spotguard.operations.checkpoint`, as the agent runs it), a real reporter sending to a
real HTTP endpoint. What each request's waiter hears, what is reported, and the worker's
state after each outcome."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import TOKEN, EventSink, Host, job_argv, proc_state, wait_until

from spotguard import operations
from spotguard.agent.metrics import AgentMetrics
from spotguard.agent.reporter import Reporter
from spotguard.agent.worker import JobWorker, Request
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.contracts import Mode
from spotguard.errors import ContainerError, PreflightError
from spotguard.facts import InstanceFacts
from spotguard.image import ImageSettings
from spotguard.notices.base import Cloud, Notice, NoticeKind

pytestmark = pytest.mark.criu

LONG_JOB = job_argv("--steps", "4000", "--step-seconds", "0.05", "--mb", "4", "--gpu", "no")


@pytest.fixture
async def job(host: Host) -> AsyncIterator[JobInfo]:
    info = await start_job(LONG_JOB, "train", state_dir=host.state)
    try:
        yield info
    finally:
        if proctree.alive(info.pid):
            os.kill(info.pid, signal.SIGKILL)


def worker_for(
    info: JobInfo, host: Host, store: str, reporter: Reporter, metrics: AgentMetrics
) -> JobWorker:
    settings = host.checkpoint_settings()

    async def checkpoint(
        mode: Mode, deadline: datetime | None, meta: dict[str, Any], on_frozen: Any
    ) -> operations.CheckpointResult:
        return await operations.checkpoint(
            info, store, mode=mode, settings=settings, image_settings=ImageSettings(),
            deadline=deadline, instance=InstanceFacts(), meta=meta, on_frozen=on_frozen,
        )  # fmt: skip

    return JobWorker(
        info.name, info.pid, checkpoint, reporter=reporter, metrics=metrics,
        instance={"provider": "local", "instance_id": "vm-here"},
    )  # fmt: skip


def request(key: str, mode: Mode, *, in_s: float = 0.0) -> tuple[Request, asyncio.Future[Any]]:
    now = datetime.now(UTC)
    notice = Notice(key, Cloud.AWS, NoticeKind.PREEMPT, now + timedelta(seconds=120), "stop")
    done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    req = Request(key, mode, now + timedelta(seconds=in_s), "test", notice=notice, waiters=[done])
    return req, done


async def test_a_resume_then_an_exit_each_make_an_image_and_are_reported(
    host: Host, sink: EventSink, job: JobInfo, tmp_path: Path
) -> None:
    metrics = AgentMetrics()
    reporter = Reporter(sink.url, TOKEN, tmp_path / "outbox", metrics=metrics)
    await reporter.start()
    worker = worker_for(job, host, f"file://{tmp_path}/store", reporter, metrics)
    running = asyncio.create_task(worker.run())
    try:
        first, resumed = request("n1", Mode.RESUME)
        assert worker.submit(first)
        assert not worker.submit(request("n1", Mode.RESUME)[0])  # one request per notice
        line = await asyncio.wait_for(resumed, 120)
        assert line["state"] == "protecting" and line["url"].startswith("file://")
        assert proctree.alive(job.pid) and worker.checkpoints == 1
        later, stays = request("n3", Mode.RESUME, in_s=300)  # not due before the exit
        worker.submit(later)
        last, exited = request("n2", Mode.EXIT)
        worker.submit(last)
        line = await asyncio.wait_for(exited, 120)
        assert line["state"] == "exited" and worker.state == "exited"
        assert (await asyncio.wait_for(stays, 5))["state"] == "exited"  # released with it
        await asyncio.wait_for(running, 10)  # the worker ends with the job
        assert not proctree.alive(job.pid)
        assert await reporter.flush(10)
        assert sink.kinds("train") == ["frozen", "durable", "frozen", "durable", "exited"]
        assert metrics.checkpoints.labels("train", "exit")._value.get() == 1
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await reporter.aclose()


async def test_a_failed_checkpoint_keeps_the_job_protected_and_a_gone_job_finishes(
    host: Host, sink: EventSink, job: JobInfo, tmp_path: Path
) -> None:
    metrics = AgentMetrics()
    reporter = Reporter(sink.url, TOKEN, tmp_path / "outbox", metrics=metrics)
    await reporter.start()
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the store's directory should be")
    worker = worker_for(job, host, blocked.as_uri(), reporter, metrics)
    running = asyncio.create_task(worker.run())
    try:
        req, failed = request("n1", Mode.RESUME)
        worker.submit(req)
        line = await asyncio.wait_for(failed, 120)
        # tried twice (a store's error may pass: tried again while the deadline allows)
        assert "error" in line and worker.state == "protecting" and worker.failures == 2
        assert proctree.alive(job.pid) and proc_state(job.pid) != "T"  # thawed
        waiting, cancelled = request("n2", Mode.RESUME, in_s=300)
        worker.submit(waiting)
        assert worker.cancel("n2") and (await cancelled) == {"job": "train", "cancelled": True}
        os.kill(job.pid, signal.SIGKILL)
        await wait_until(lambda: not worker.alive(), 10)
        req, gone = request("n3", Mode.RESUME)
        worker.submit(req)
        assert (await asyncio.wait_for(gone, 10))["state"] == "finished"
        assert worker.state == "finished"
        assert await reporter.flush(10)
        kinds = sink.kinds("train")
        assert "checkpoint_failed" in kinds and kinds[-1] == "job_finished"
        fail, again = [e for e in sink.events if e["kind"] == "checkpoint_failed"]
        assert fail["notice"]["id"] == again["notice"]["id"] == "n1" and fail["error"]["message"]
        assert metrics.failures.labels(fail["step"])._value.get() == 2
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await reporter.aclose()


class _Flaky:
    """The worker's checkpointer, failing the next ``fail`` calls with ``error``."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls: list[Mode] = []
        self.fail = 0
        self.error: Exception = ContainerError("checkpointing podman:train: criu: Timeout reached")

    async def __call__(
        self, mode: Mode, deadline: datetime | None, meta: dict[str, Any], on_frozen: Any
    ) -> operations.CheckpointResult:
        self.calls.append(mode)
        if self.fail > 0:
            self.fail -= 1
            raise self.error
        result: operations.CheckpointResult = await self.real(mode, deadline, meta, on_frozen)
        return result


async def test_a_notice_checkpoint_that_fails_retryably_is_tried_again_before_its_deadline(
    host: Host, sink: EventSink, job: JobInfo, tmp_path: Path
) -> None:
    """CI saw podman's exit checkpoint fail once ("Timeout reached" freezing a container
    restored in place 2 s before) and the job then sat unprotected until its VM went: a
    notice's checkpoint that fails with a retryable error is tried again while its deadline
    allows; its waiter hears the image, and the failure is still reported."""
    metrics = AgentMetrics()
    reporter = Reporter(sink.url, TOKEN, tmp_path / "outbox", metrics=metrics)
    await reporter.start()
    worker = worker_for(job, host, f"file://{tmp_path}/store", reporter, metrics)
    flaky = _Flaky(worker.checkpointer)
    worker.checkpointer = flaky
    running = asyncio.create_task(worker.run())
    try:
        flaky.fail = 1
        req, done = request("n1", Mode.RESUME)
        worker.submit(req)
        line = await asyncio.wait_for(done, 120)
        assert str(line.get("url", "")).startswith("file://"), line
        assert flaky.calls == [Mode.RESUME, Mode.RESUME]
        assert worker.failures == 1 and worker.checkpoints == 1 and worker.state == "protecting"
        assert await reporter.flush(10)
        kinds = sink.kinds("train")
        assert "checkpoint_failed" in kinds
        assert kinds.index("checkpoint_failed") < kinds.index("durable"), kinds

        # tried once more only: a second failure is the waiter's answer
        flaky.calls, flaky.fail = [], 2
        req, done = request("n2", Mode.RESUME)
        worker.submit(req)
        assert "error" in await asyncio.wait_for(done, 60)
        assert flaky.calls == [Mode.RESUME, Mode.RESUME]

        # a failure that cannot pass by trying again is not retried
        flaky.calls, flaky.fail = [], 1
        flaky.error = PreflightError("the job holds a socket CRIU cannot dump")
        req, done = request("n3", Mode.RESUME)
        worker.submit(req)
        assert "error" in await asyncio.wait_for(done, 60) and flaky.calls == [Mode.RESUME]

        # nor one whose deadline leaves no time for another try
        flaky.calls, flaky.fail = [], 1
        flaky.error = ContainerError("checkpointing podman:train: criu: Timeout reached")
        req, done = request("n4", Mode.RESUME)
        assert req.notice is not None
        req.notice = dataclasses.replace(
            req.notice, deadline=datetime.now(UTC) + timedelta(seconds=10)
        )
        worker.submit(req)
        assert "error" in await asyncio.wait_for(done, 60) and flaky.calls == [Mode.RESUME]
        assert proctree.alive(job.pid) and worker.failures == 1 + 2 + 1 + 1
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await reporter.aclose()
