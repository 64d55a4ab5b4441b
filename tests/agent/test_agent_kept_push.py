"""An exit whose upload fails after the job was stopped: the staged image is kept, the agent
pushes it again with backoff — across an agent restart — and once the store is back the image
is durable, reported and restores to the same output as an uninterrupted run.

The store is real S3 (a moto server) behind a TCP proxy that drops every connection while
broken. The agent streams by default; with the store unreachable the streamer cannot open the
image, so the engine stages instead (before the job is touched)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator

import pytest
from agent_helpers import (
    EventSink,
    FlakyProxy,
    Host,
    job_argv,
    job_output_when_done,
    running_agent,
    wait_until,
)

from spotguard import operations
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.image import ImageSettings, latest_image
from spotguard.simulator import MetadataSim

pytestmark = pytest.mark.criu

#: the sample job's arguments with 200 steps (10 s)
LONG = ("--steps", "200", "--step-seconds", "0.05", "--mb", "4", "--seed", "7", "--gpu", "no")


def _reference(args: tuple[str, ...]) -> str:
    """What the sample job prints with ``args`` uninterrupted (its output does not depend on
    the step time: run at full speed)."""
    fast = list(args)
    fast[fast.index("--step-seconds") + 1] = "0"
    return subprocess.run(job_argv(*fast), capture_output=True, text=True, check=True).stdout


@pytest.fixture
async def sim(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MetadataSim]:
    async with MetadataSim() as s:
        for key, value in s.env().items():
            monkeypatch.setenv(key, value)
        yield s


@pytest.fixture
def proxy(aws_env: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FlakyProxy]:
    import boto3

    boto3.client("s3").create_bucket(Bucket="kept")
    p = FlakyProxy(aws_env).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
    monkeypatch.setenv("SPOTGUARD_RETRIES", "1")  # fail fast; the agent's pusher retries
    try:
        yield p
    finally:
        p.stop()


async def test_kept_image_is_pushed_once_the_store_heals_even_across_a_restart(
    host: Host, sink: EventSink, sim: MetadataSim, proxy: FlakyProxy
) -> None:
    store = "s3://kept/spotguard"
    # 10 s of steps: the agent's start waits out the broken store (up to 5 s), and the
    # 3.5 s sample job had ended before the notice's freeze on a slow run
    job: JobInfo = await start_job(job_argv(*LONG), "train", state_dir=host.state)
    try:
        proxy.broken = True
        async with running_agent(
            host, sink, job=["train"], store=store, push_retry_max_s=0.3
        ) as agent:
            await wait_until(lambda: "started" in sink.kinds("train"))
            sim.state.send("aws", "preempt", in_seconds=120)
            await wait_until(lambda: "checkpoint_failed" in sink.kinds("train"))
            failed = next(e for e in sink.events if e["kind"] == "checkpoint_failed")
            assert (failed["step"], failed["kept"]) == ("upload", True)
            assert not proctree.alive(job.pid)  # stopped: the kept image is all there is
            worker = agent.workers["train"]
            assert worker.state == "pushing"
            await wait_until(lambda: agent.pusher.status()[0]["attempts"] >= 2)
            status = agent.status()
            [kept] = status["agent"]["kept_images"]
            assert kept["job"] == "train" and kept["store_url"] == store
            assert status["jobs"][0]["kept"] and status["jobs"][0]["state"] == "pushing"
            assert b"spotguard_kept_images 1.0" in agent.metrics.render()
        # The agent stopped with the store still down: the image waits on this host.
        [record] = operations.kept_images_of(host.checkpoint_settings()).scan()
        assert record.dir.is_dir() and "durable" not in sink.kinds("train")

        # A new agent (no metadata service needed: cloud none) carries on and the store heals.
        async with running_agent(
            host, sink, cloud="none", job=["train"], store=store, push_retry_max_s=0.3
        ) as agent2:
            await wait_until(
                lambda: agent2.pusher.status() and agent2.pusher.status()[0]["attempts"] >= 1
            )
            proxy.broken = False
            await wait_until(lambda: "exited" in sink.kinds("train"))
            assert agent2.workers["train"].state == "exited"
            assert b"spotguard_kept_images 0.0" in agent2.metrics.render()
        assert proxy.dropped > 0
        durable = next(e for e in sink.events if e["kind"] == "durable")
        assert durable["mode"] == "exit"
        assert durable["notice"]["kind"] == "preempt"  # the exit it completes
        assert durable["instance"]["instance_type"] == "g5.xlarge"
        assert (
            operations.kept_images_of(host.checkpoint_settings()).scan() == []
            and not record.dir.exists()
        )
        assert await latest_image(store, "train", settings=ImageSettings()) == durable["image_url"]
        assert "job_finished" not in sink.kinds("train")

        restored = await operations.restore(
            durable["image_url"],
            settings=host.checkpoint_settings(),
            image_settings=ImageSettings(),
        )
        assert restored.job.name == "train"
        assert await job_output_when_done(job.dir) == _reference(LONG)
    finally:
        for pid in (job.pid,):
            if proctree.alive(pid):
                os.kill(pid, signal.SIGKILL)
