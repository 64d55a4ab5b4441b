"""kill -9 of the process running a checkpoint, at each step of the freeze, with real CRIU, a
real job and a real ``file://`` store.

A child process runs the one composition the agent and the CLI use
(``operations.checkpoint``: streamed or staged path → engine → image writer) with the engine's
``Faults`` seam pausing before one step; the test SIGKILLs it there. Then
``operations.recover`` (what the agent runs at start-up) must bring the job back — alive, not
stopped, making progress — and the store must hold no image with a manifest: a half-written
image never looks complete.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sgtest import grows
from spotguard.checkpoint import proctree
from spotguard.checkpoint.engine import MARKER
from spotguard.checkpoint.jobs import JobInfo, list_jobs, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image import ImageSettings, list_images
from spotguard.operations import recover

pytestmark = [pytest.mark.criu, pytest.mark.timeout(120)]

DEMO = [sys.executable, "-m", "spotguard.demo.job", "--gpu", "no", "--mb", "4"]
LONG = [*DEMO, "--steps", "100000", "--step-seconds", "0.02"]
IMG = ImageSettings(chunk_size=1 << 20, workers=1, max_inflight_mb=4)

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from spotguard import operations
    from spotguard.checkpoint.criu import Criu
    from spotguard.checkpoint.engine import Engine
    from spotguard.checkpoint.jobs import resolve_job
    from spotguard.checkpoint.settings import CheckpointSettings
    from spotguard.contracts import Mode
    from spotguard.image import ImageSettings

    class PauseAt:
        def __init__(self, step):
            self.step = step

        async def before(self, step):
            if step == self.step:
                print("at", step, flush=True)
                await asyncio.sleep(3600)

    async def main():
        state, shm, criu, job, store, mode, stream, step = sys.argv[1:9]
        s = CheckpointSettings(state_dir=Path(state), shm_dir=Path(shm), criu=criu)
        eng = Engine(Criu(criu), settings=s, faults=PauseAt(step))
        img = ImageSettings(chunk_size=1 << 20, workers=1, max_inflight_mb=4)
        await operations.checkpoint(
            resolve_job(job, state_dir=s.state_dir), store, mode=Mode(mode), settings=s,
            image_settings=img, engine=eng, stream=stream)
        print("finished", flush=True)

    asyncio.run(main())
    """
)


@pytest.fixture
async def job(settings: CheckpointSettings) -> AsyncIterator[JobInfo]:
    j = await start_job(LONG, "victim", state_dir=settings.state_dir)
    await grows(j.dir / "stdout", 3)
    yield j
    for k in list_jobs(settings.state_dir):
        if proctree.alive(k.pid):
            proctree.signal_all([k.pid], signal.SIGKILL)


def _stopped(pid: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1] in ("T", "t")
    except OSError:
        return False
    return False


CASES = [
    # (path, mode, step): every step the engine takes without a GPU, both modes, streamed
    # (the default) — and the staged path where it differs: the tree frozen, the image staged
    ("stream", "resume", "scan"),
    ("stream", "resume", "criu_dump"),
    ("stream", "resume", "capture_files"),
    ("stream", "resume", "finish"),
    ("stream", "exit", "scan"),
    ("stream", "exit", "criu_dump"),
    ("stream", "exit", "capture_files"),
    ("stream", "exit", "finish"),
    ("stage", "resume", "capture_files"),
    ("stage", "resume", "finish"),
    ("stage", "exit", "capture_files"),
    ("stage", "exit", "finish"),
]


@pytest.mark.parametrize(("path", "mode", "step"), CASES)
async def test_kill_9_at_each_freeze_step_then_recover(
    settings: CheckpointSettings,
    job: JobInfo,
    tmp_path: Path,
    path: str,
    mode: str,
    step: str,
) -> None:
    store = (tmp_path / "store").as_uri()
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        str(settings.state_dir),
        str(settings.shm_dir),
        str(settings.criu),
        job.name,
        store,
        mode,
        "on" if path == "stream" else "off",
        step,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert child.stdout is not None and child.stderr is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), 60)
    except TimeoutError:
        child.kill()
        raise
    if line.strip() != f"at {step}".encode():
        child.kill()
        await child.wait()
        pytest.fail(f"the checkpoint never reached {step}: {(await child.stderr.read())[-2000:]!r}")
    assert (job.dir / MARKER).exists()
    if step in ("capture_files",) or (step == "finish" and mode == "exit"):
        assert all(_stopped(p) for p in proctree.tree(job.pid)), "the tree is not frozen here"
    os.kill(child.pid, signal.SIGKILL)
    await child.wait()

    assert await recover(job, settings=settings) is True
    assert not (job.dir / MARKER).exists()
    assert await recover(job, settings=settings) is False
    assert proctree.alive(job.pid), "the job died with the checkpoint"
    assert not any(_stopped(p) for p in proctree.tree(job.pid)), "the job was left stopped"
    await grows(job.dir / "stdout", 3)
    images = await list_images(store, job.name, settings=IMG)
    assert not [i for i in images if i.complete], "a killed checkpoint left a complete image"
