"""The agent as a real process, killed -9 in the middle of a freeze: a restarted agent finds the
job running (not frozen) and the previous complete image intact and restorable, and removes
the work directories the killed one left in its temp dir."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from agent_helpers import (
    TOKEN,
    EventSink,
    Host,
    job_argv,
    proc_state,
    wait_until,
)

from sgtest import line_count
from spotguard import operations
from spotguard.checkpoint import proctree
from spotguard.checkpoint.engine import MARKER
from spotguard.checkpoint.jobs import start_job
from spotguard.image import ImageSettings, latest_image, verify_image
from spotguard.simulator import MetadataSim

pytestmark = pytest.mark.criu

# Enough memory that the dump takes a moment on two cores, so the kill lands inside it; a
# minute of steps, so that the job still runs when the second agent checkpoints it however
# loaded the host (at 7.8 s and at 15 s loaded clean-clone runs saw it end first: "job
# finished by itself"). The restored job is compared line for line with an uninterrupted run
# over its first MORE lines past the restore, then both are stopped.
BIG = ("--steps", "2000", "--step-seconds", "0.03", "--mb", "384", "--seed", "3", "--gpu", "no")
MORE = 40


@pytest.fixture
async def sim() -> AsyncIterator[MetadataSim]:
    async with MetadataSim() as s:
        yield s


async def start_agent(
    host: Host, sim: MetadataSim, sink: EventSink, store: str, log: Path
) -> asyncio.subprocess.Process:
    exe = Path(sys.executable).parent / "spotguard"
    tmp = log.parent / "agent-tmp"  # the agent's own temp dir: its work directories
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, **sim.env(), "SPOTGUARD_LOG_FORMAT": "json", "TMPDIR": str(tmp)}
    # The kill must land while CRIU holds the tree. A leave-running image held in memory
    # (resume_buffer_mb, by default) frees the job after its copy-out, a few tenths of a
    # second here, which a loaded machine's poll can miss; 0 keeps it frozen for the upload.
    env["SPOTGUARD_RESUME_BUFFER_MB"] = "0"
    with log.open("ab") as err:
        return await asyncio.create_subprocess_exec(
            str(exe), "agent", "--job", "train", "--store", store, "--cloud", "aws",
            "--poll-interval", "0.2", "--state-dir", str(host.state), "--shm-dir", str(host.shm),
            "--criu", host.criu, "--api-listen", "127.0.0.1:0",
            "--assignment", str(host.state / "none.json"), "--periodic-interval", "3600",
            "--controller-url", sink.url,
            env={**env, "SPOTGUARD_CONTROLLER_TOKEN": TOKEN},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=err, start_new_session=True,
        )  # fmt: skip


def _work_dirs(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "agent-tmp").iterdir() if p.is_dir())


async def test_agent_killed_during_freeze_leaves_job_running_and_last_image_intact(
    host: Host, sink: EventSink, sim: MetadataSim, tmp_path: Path
) -> None:
    reference = await asyncio.create_subprocess_exec(
        *job_argv(*BIG), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    job = await start_job(job_argv(*BIG), "train", state_dir=host.state)
    store = f"file://{tmp_path}/store"
    log = tmp_path / "agent.log"
    agent = await start_agent(host, sim, sink, store, log)
    try:
        # The first periodic checkpoint (there was no image yet) is the "previous" image.
        await wait_until(lambda: "durable" in sink.kinds("train"), 60)
        previous = next(e for e in sink.events if e["kind"] == "durable")["image_url"]

        sim.state.send("aws", "rebalance")
        await wait_until(lambda: proc_state(job.pid) in ("t", "T"), 30)  # CRIU holds the tree
        assert (job.dir / MARKER).exists()
        os.killpg(agent.pid, signal.SIGKILL)
        await agent.wait()
        left = _work_dirs(tmp_path)
        assert left, "the killed freeze left no work directory: the kill missed the freeze"

        agent = await start_agent(host, sim, sink, store, log)
        await wait_until(
            lambda: any(
                e["kind"] == "checkpoint_failed" and e.get("step") == "recover" for e in sink.events
            ),
            60,
        )
        # The rebalance recommendation is still posted: the new agent checkpoints afresh.
        try:
            await wait_until(lambda: sink.kinds("train").count("durable") >= 2, 60)
        except BaseException:
            tail = "\n".join(log.read_text().splitlines()[-25:])
            print(f"events: {sink.kinds('train')}\nagent log:\n{tail}")
            raise
        assert not (job.dir / MARKER).exists()
        assert not set(left) & set(_work_dirs(tmp_path)), "the killed agent's work dirs stay"
        assert proc_state(job.pid) in ("R", "S")
        size = (job.dir / "stdout").stat().st_size
        await wait_until(lambda: (job.dir / "stdout").stat().st_size > size, 10)  # it runs
        latest = next(e for e in reversed(sink.events) if e["kind"] == "durable")["image_url"]
        assert await latest_image(store, "train", settings=ImageSettings()) == latest != previous
        assert (await verify_image(previous, settings=ImageSettings())).ok
    finally:
        if agent.returncode is None:
            agent.send_signal(signal.SIGTERM)
            await asyncio.wait_for(agent.wait(), 60)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steps = {line.get("step") for line in lines}
    assert {"start", "protect", "notice", "checkpoint", "durable", "recover"} <= steps

    # The previous image is still the restorable state of the job: restored, it goes on
    # exactly as an uninterrupted run of the job does.
    os.kill(job.pid, signal.SIGKILL)
    await wait_until(lambda: not proctree.alive(job.pid), 10)
    restored = await operations.restore(
        previous, settings=host.checkpoint_settings(), image_settings=ImageSettings()
    )
    try:
        upto = line_count(job.dir / "stdout") + MORE
        await wait_until(lambda: line_count(job.dir / "stdout") >= upto, 60)
        assert reference.stdout is not None
        expected = [(await reference.stdout.readline()).decode() for _ in range(upto)]
        assert (job.dir / "stdout").read_text().splitlines(keepends=True)[:upto] == expected
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(restored.pid, signal.SIGKILL)
        reference.kill()
        await reference.wait()
