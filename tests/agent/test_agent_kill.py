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

from sgtest import line_count, store_servers
from spotguard import operations
from spotguard.checkpoint import proctree
from spotguard.checkpoint.engine import MARKER
from spotguard.checkpoint.jobs import start_job
from spotguard.image import ImageSettings, latest_image, verify_image
from spotguard.image.catalog import list_images
from spotguard.simulator import MetadataSim

pytestmark = pytest.mark.criu

FaultProxy = store_servers().FaultProxy  # type: ignore[attr-defined]

# Enough memory that the dump takes a moment on two cores, so the kill lands inside it; a
# minute of steps, so that the job still runs when the second agent checkpoints it however
# loaded the host (at 7.8 s and at 15 s loaded clean-clone runs saw it end first: "job
# finished by itself"). The restored job is compared line for line with an uninterrupted run
# over its first MORE lines past the restore, then both are stopped.
BIG = ("--steps", "2000", "--step-seconds", "0.03", "--mb", "384", "--seed", "3", "--gpu", "no")
MORE = 40


async def start_agent(
    host: Host, sim: MetadataSim, sink: EventSink, store: str, log: Path, *, hold: bool = False
) -> asyncio.subprocess.Process:
    exe = Path(sys.executable).parent / "spotguard"
    tmp = log.parent / "agent-tmp"  # the agent's own temp dir: its work directories
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, **sim.env(), "SPOTGUARD_LOG_FORMAT": "json", "TMPDIR": str(tmp)}
    if not hold:
        # The kill must land while CRIU holds the tree. A leave-running image held in memory
        # (resume_buffer_mb, by default) frees the job after its copy-out, a few tenths of a
        # second here, which a loaded machine's poll can miss; 0 keeps it frozen for the
        # upload.
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


def _parasites(root: int) -> list[int]:
    """The job's processes that still map CRIU's parasite (its memfd)."""
    return [p for p in proctree.tree(root) if "CRIUMFD" in Path(f"/proc/{p}/maps").read_text()]


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
        assert not _parasites(job.pid), "the killed agent's CRIU left its parasite in the job"
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


#: The held-window job: it only has to outlive three checkpoints, with less memory to move
HELD = ("--steps", "2000", "--step-seconds", "0.03", "--mb", "64", "--seed", "5", "--gpu", "no")


async def test_agent_killed_while_a_held_pause_uploads_leaves_the_job_running_and_no_image(
    host: Host,
    sink: EventSink,
    sim: MetadataSim,
    tmp_path: Path,
    fault_proxy: FaultProxy,
    s3_bucket: str,
) -> None:
    """The default leave-running checkpoint lets the job go on once its image is in host
    memory, before the store has it. An agent killed in that window (its uploads hang) must
    leave the job running, never frozen again, and no image of the killed checkpoint: a
    restarted agent recovers (the marker says a checkpoint was cut short), its fresh
    checkpoint becomes the latest image, and the one before it is intact."""
    job = await start_job(job_argv(*HELD), "train", state_dir=host.state)
    store = f"{s3_bucket}/images"
    log = tmp_path / "agent.log"
    agent = await start_agent(host, sim, sink, store, log, hold=True)
    try:
        await wait_until(lambda: "durable" in sink.kinds("train"), 60)
        previous = next(e for e in sink.events if e["kind"] == "durable")["image_url"]

        stuck = fault_proxy.add("PUT", "/chunks/", "hang", times=1_000_000)
        sim.state.send("aws", "rebalance")
        await wait_until(lambda: stuck.hits >= 1, 60)  # the new image's upload hangs ...
        size = (job.dir / "stdout").stat().st_size
        await wait_until(lambda: (job.dir / "stdout").stat().st_size > size, 30)  # ... job runs
        assert proc_state(job.pid) in ("R", "S")
        assert (job.dir / MARKER).exists(), "the checkpoint is not over until its image is"
        assert sink.kinds("train").count("durable") == 1
        os.killpg(agent.pid, signal.SIGKILL)
        await agent.wait()
        fault_proxy.faults.clear()
        fault_proxy.released.set()  # the dead agent's hung requests end

        agent = await start_agent(host, sim, sink, store, log, hold=True)
        await wait_until(
            lambda: any(
                e["kind"] == "checkpoint_failed" and e.get("step") == "recover" for e in sink.events
            ),
            60,
        )
        await wait_until(lambda: sink.kinds("train").count("durable") >= 2, 60)
        assert not (job.dir / MARKER).exists()
        assert proc_state(job.pid) in ("R", "S")
        assert not _parasites(job.pid), "the killed agent's CRIU left its parasite in the job"
        size = (job.dir / "stdout").stat().st_size
        await wait_until(lambda: (job.dir / "stdout").stat().st_size > size, 10)  # it runs
        latest = next(e for e in reversed(sink.events) if e["kind"] == "durable")["image_url"]
        assert await latest_image(store, "train", settings=ImageSettings()) == latest
        # two complete images: the killed checkpoint's never got a manifest
        images = await list_images(store, "train", settings=ImageSettings())
        assert sorted(i.url for i in images if i.complete) == sorted([previous, latest])
        assert len(images) == 3, [(i.image_id, i.complete) for i in images]  # + the cut one
        assert (await verify_image(previous, settings=ImageSettings())).ok
    finally:
        if agent.returncode is None:
            agent.send_signal(signal.SIGTERM)
            await asyncio.wait_for(agent.wait(), 60)
        with contextlib.suppress(ProcessLookupError):  # a job already gone must not hide why
            os.kill(job.pid, signal.SIGKILL)
