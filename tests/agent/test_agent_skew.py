"""Clock skew (issue 31, item 10): the job's newest image was written on a VM whose clock ran a
day ahead, so its id says tomorrow. The agent that protects the job next used that id as the
image's time: periodic checkpoints were due tomorrow (silently off) and
``spotguard_last_image_age_seconds`` read 0, so no alert fired. An image dated in the future
is now counted as taken when the agent first saw it."""

from __future__ import annotations

import os
import signal
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from agent_helpers import EventSink, Host, job_argv, running_agent, wait_until

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import start_job
from spotguard.contracts import new_image_id
from spotguard.image import ImageSettings, push_dir

LONG_JOB = job_argv("--steps", "4000", "--step-seconds", "0.05", "--mb", "4", "--gpu", "no")


@pytest.mark.criu
async def test_an_image_dated_tomorrow_does_not_turn_periodic_checkpoints_off(
    host: Host, sink: EventSink, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    src = tmp_path / "fast-clock-image"
    src.mkdir()
    (src / "pages-1.img").write_bytes(b"\x07" * 4096)
    tomorrow = datetime.now(UTC) + timedelta(days=1)
    await push_dir(
        src, store, "train", {}, image_id=new_image_id(tomorrow), settings=ImageSettings()
    )
    job = await start_job(LONG_JOB, "train", state_dir=host.state)
    try:
        async with running_agent(
            host, sink, cloud="none", job=["train"], store=store, periodic_interval=3.0
        ) as agent:
            await wait_until(lambda: "started" in sink.kinds("train"), 30)
            [st] = agent.status()["jobs"]
            due = datetime.fromisoformat(st["next_periodic"])
            assert due < datetime.now(UTC) + timedelta(seconds=10), st["next_periodic"]
            await wait_until(lambda: "durable" in sink.kinds("train"), 60)
            [durable] = [e for e in sink.events if e["kind"] == "durable"]
            assert durable["mode"] == "resume"
            age = agent.metrics.render().decode()
            line = next(x for x in age.splitlines() if x.startswith("spotguard_last_image_age"))
            assert float(line.rsplit(" ", 1)[-1]) < 60
        assert proctree.alive(job.pid)
    finally:
        if proctree.alive(job.pid):
            os.kill(job.pid, signal.SIGKILL)
