"""A ``file://`` store reached through a symlink (issue 31, item 9), with a real agent, real
CRIU, real jobs and real directories:

* the store root, or a parent of it, is a symlink: every drain failed ("… is not in the
  subpath of …", the store's listing compared the link's path with the real one), and with
  streaming off the stopped job's kept image was never pushed. Now the store names objects
  under its real path and the agent resolves the URL once at start (logged): drains work,
  streamed and staged;
* the store's real directory taken away under the link (moved, a file in its place) and put
  back: the kept image's pusher died on the first unexpected error and the job stayed
  "pushing" forever. Now it retries with backoff, whatever the error, until the push lands.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
from agent_helpers import EventSink, Host, job_argv, running_agent, wait_until

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import start_job
from spotguard.image import ImageSettings, list_images

pytestmark = [pytest.mark.criu, pytest.mark.timeout(180)]

LONG_JOB = job_argv("--steps", "4000", "--step-seconds", "0.05", "--mb", "4", "--gpu", "no")


def _put_back(away: Path, real: Path) -> None:
    """Move the store's directory back under its name. The pusher retries meanwhile, in its
    own threads: between the test's removal of the stand-in file and this rename it may make
    the directory again (one run failed so, "Directory not empty"), so what it made there is
    cleared and the rename tried again."""
    for _ in range(100):
        try:
            away.rename(real)
            return
        except OSError:
            shutil.rmtree(real, ignore_errors=True)
    raise AssertionError(f"{real} kept being made again")


def _linked_store(tmp_path: Path, where: str) -> tuple[str, Path]:
    """A store URL whose root (``root``) or parent (``parent``) is a symlink; its real dir."""
    real_parent = tmp_path / "disk"
    real = real_parent / "store"
    real.mkdir(parents=True)
    if where == "root":
        (tmp_path / "store").symlink_to(real, target_is_directory=True)
        return f"file://{tmp_path}/store", real
    (tmp_path / "mnt").symlink_to(real_parent, target_is_directory=True)
    return f"file://{tmp_path}/mnt/store", real


@pytest.mark.parametrize("stream", ["auto", "off"])
@pytest.mark.parametrize("where", ["root", "parent"])
async def test_a_file_store_reached_through_a_symlink_takes_every_drain(
    host: Host, sink: EventSink, tmp_path: Path, where: str, stream: str,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    store, real = _linked_store(tmp_path, where)
    job = await start_job(LONG_JOB, "train", state_dir=host.state)
    try:
        with caplog.at_level(logging.INFO, logger="spotguard.agent.startup"):
            async with running_agent(
                host, sink, cloud="none", job=["train"], store=store,
                checkpoint={"stream": stream},
            ) as agent:  # fmt: skip
                await wait_until(lambda: "started" in sink.kinds("train"), 30)
                resolved = agent.store
                answer = await agent.drain("maintenance", wait=True, deadline_s=60)
                [result] = answer["results"]
                assert result.get("url"), answer
        assert "durable" in sink.kinds("train") and "exited" in sink.kinds("train")
        assert [i.url for i in await list_images(real.as_uri(), "train", settings=ImageSettings())]
        assert await list_images(store, "train", settings=ImageSettings())  # through the link
        assert resolved == real.as_uri()  # resolved once at start, and logged:
        assert any(r.__dict__.get("path") == str(real) for r in caplog.records)
    finally:
        if proctree.alive(job.pid):
            os.kill(job.pid, signal.SIGKILL)


async def test_a_store_directory_taken_away_and_put_back_gets_the_kept_image(
    host: Host, sink: EventSink, tmp_path: Path
) -> None:
    store, real = _linked_store(tmp_path, "root")
    away = real.with_name("store.away")
    job = await start_job(LONG_JOB, "train", state_dir=host.state)
    try:
        async with running_agent(
            host, sink, cloud="none", job=["train"], store=store, push_retry_max_s=1.0
        ) as agent:  # fmt: skip
            await wait_until(lambda: "started" in sink.kinds("train"), 30)
            real.rename(away)
            real.write_text("not a directory")  # the store's directory is gone
            answer = await agent.drain("maintenance", wait=True, deadline_s=60)
            assert not any(r.get("url") for r in answer["results"]), answer
            assert not proctree.alive(job.pid)  # stopped: its image is kept on the host
            await wait_until(lambda: any(p["attempts"] >= 3 for p in agent.pusher.status()), 30)
            real.unlink()
            _put_back(away, real)
            await wait_until(lambda: "exited" in sink.kinds("train"), 30)
            assert agent.pusher.status() == []
            assert agent.workers["train"].state == "exited"
        assert await list_images(store, "train", settings=ImageSettings())
    finally:
        if proctree.alive(job.pid):
            os.kill(job.pid, signal.SIGKILL)
        await asyncio.sleep(0)
