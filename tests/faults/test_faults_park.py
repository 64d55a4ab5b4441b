"""kill -9 of the process running a park or an unpark (issue 31 item 12), with real CRIU, a
real job and the GPU stand-in of :mod:`sg_gpu_standin` (the driver's state machine, kept in a
file so it outlives the killed process, as the driver's state does).

A child process runs ``park.core.park`` / ``unpark`` with the engine it is given — the
engine's ``Faults`` seam, or the GPU stand-in, pausing at one instant — and the test SIGKILLs
it there. Then the engine's ``recover`` (what a restarted agent runs at start-up) must find
the job and bring it back running: never left stopped, GPU-locked or GPU-checkpointed, no park
record naming a job that runs. What a killed park to tmpfs or disk wrote (a partial image) is
cleaned by the next park or unpark, never kept for ever.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
from sg_gpu_standin import FileGpu

from sgtest import grows
from spotguard.agent import startup
from spotguard.checkpoint import proctree, suspend
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import MARKER, Engine
from spotguard.checkpoint.jobs import JobInfo, list_jobs, resolve_job, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.park import core, record
from spotguard.park.settings import ParkSettings
from spotguard.statedir import StateDir

pytestmark = [pytest.mark.criu, pytest.mark.timeout(120)]

DEMO = [sys.executable, "-m", "spotguard.demo.job", "--gpu", "no", "--mb", "4"]
LONG = [*DEMO, "--steps", "100000", "--step-seconds", "0.02"]
HERE = str(Path(__file__).parent)

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from sg_gpu_standin import FileGpu, PauseAt
    from spotguard.checkpoint.criu import Criu
    from spotguard.checkpoint.engine import Engine
    from spotguard.checkpoint.jobs import resolve_job
    from spotguard.checkpoint.settings import CheckpointSettings
    from spotguard.park import core
    from spotguard.park.settings import ParkSettings

    async def main():
        here, state, shm, criu, job, gpufile, gpu, op, to, pause = sys.argv[1:11]
        s = CheckpointSettings(state_dir=Path(state), shm_dir=Path(shm), criu=criu,
                               criu_timeout=60)
        ps = ParkSettings(memory_dir=Path(shm) / "parked")
        after = pause.removeprefix("gpu:") if pause.startswith("gpu:") else None
        step = pause.removeprefix("step:") if pause.startswith("step:") else None
        hook = FileGpu(Path(gpufile), with_gpu=gpu == "gpu", pause_after=after)
        eng = Engine(Criu(criu), hook, settings=s, faults=PauseAt(step))
        if op == "park":
            info = resolve_job(job, state_dir=s.state_dir)
            await core.park(info, to=to, engine=eng, settings=s, park_settings=ps)
        else:
            await core.unpark(job, engine=eng, settings=s, park_settings=ps)
        print("finished", flush=True)

    asyncio.run(main())
    """
)


@pytest.fixture
def park_settings(tmp_path: Path) -> ParkSettings:
    return ParkSettings(memory_dir=tmp_path / "shm" / "parked")


@pytest.fixture
async def job(settings: CheckpointSettings) -> AsyncIterator[JobInfo]:
    # no mount namespace of its own: its image then holds no host mounts, which other tests
    # running beside this one may take away before the restore (issue 31 item 15)
    j = await start_job(LONG, "victim", state_dir=settings.state_dir, pid_namespace=False)
    await grows(j.dir / "stdout", 3)
    yield j
    for k in list_jobs(settings.state_dir):
        if proctree.alive(k.pid):  # the job's init and the program under it
            proctree.signal_all(proctree.tree(k.pid), signal.SIGKILL)
    for p in _copies(j):  # a half-restored tree no job record names
        proctree.signal_all(proctree.tree(p), signal.SIGKILL)


async def _kill_at(
    settings: CheckpointSettings,
    job: JobInfo,
    gpufile: Path,
    *,
    gpu: str,
    op: str,
    pause: str,
    to: str = "memory",
) -> None:
    """Run the park/unpark in a child until it reaches ``pause``, then SIGKILL it.
    ``criu:STAGE``: CRIU itself waits at that stage of its restore (an action script from
    ``CRIU_CONFIG_FILE``), so the child dies while CRIU restores; CRIU dies with it."""
    env = dict(os.environ)
    reached = gpufile.with_name("criu-reached")
    if pause.startswith("criu:"):
        script = gpufile.with_name("criu-action.sh")
        script.write_text(
            f'#!/bin/sh\nif [ "$CRTOOLS_SCRIPT_ACTION" = "{pause[5:]}" ]; then\n'
            f"  echo $$ > {reached}.tmp && mv {reached}.tmp {reached}\n  exec sleep 3600\nfi\n"
        )
        script.chmod(0o755)
        conf = gpufile.with_name("criu.conf")
        conf.write_text(f"action-script {script}\n")
        env["CRIU_CONFIG_FILE"] = str(conf)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        HERE,
        str(settings.state_dir),
        str(settings.shm_dir),
        str(settings.criu),
        job.name,
        str(gpufile),
        gpu,
        op,
        to,
        pause,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert child.stdout is not None and child.stderr is not None
    if pause.startswith("criu:"):
        deadline = time.monotonic() + 60
        while not reached.exists():
            if child.returncode is not None or time.monotonic() > deadline:
                child.kill()
                await child.wait()
                err = (await child.stderr.read())[-2000:]
                pytest.fail(f"CRIU never reached {pause!r}: {err!r}")
            await asyncio.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        await child.wait()
        os.kill(int(reached.read_text()), signal.SIGKILL)  # the action script's sleep
        return
    want = f"after {pause[4:]}" if pause.startswith("gpu:") else f"at {pause[5:]}"
    try:
        line = await asyncio.wait_for(child.stdout.readline(), 60)
    except TimeoutError:
        child.kill()
        raise
    if line.decode().strip() != want:
        child.kill()
        await child.wait()
        err = (await child.stderr.read())[-2000:]
        pytest.fail(f"the {op} never reached {pause!r} (got {line!r}): {err!r}")
    os.kill(child.pid, signal.SIGKILL)
    await child.wait()


async def _runs_again(job: JobInfo, hook: FileGpu, state_dir: Path) -> None:
    """The job runs: alive, no process stopped, nothing locked or checkpointed on the
    (stand-in) GPU, its output growing, and no park record says otherwise."""
    assert proctree.alive(job.pid), "the job died with the park"
    assert not any(suspend.stopped(p) for p in proctree.tree(job.pid)), "left stopped"
    assert hook.stuck_now() == {}, "left GPU-locked or GPU-checkpointed"
    assert record.load(state_dir, job.name) is None, "a park record names a running job"
    assert not (job.dir / MARKER).exists()
    await grows(job.dir / "stdout", 3)


def _engine(settings: CheckpointSettings, hook: FileGpu) -> Engine:
    return Engine(Criu(settings.criu), hook, settings=settings)


@pytest.mark.parametrize(
    ("gpu", "pause"),
    [
        ("gpu", "gpu:checkpoint"),  # GPU state moved into host memory, the tree not stopped yet
        ("gpu", "step:record"),  # GPU checkpointed and the tree stopped, no park record yet
        ("cpu", "step:record"),  # a CPU job stopped, no park record yet
    ],
)
async def test_a_park_in_place_killed_after_the_freeze_is_brought_back_by_recover(
    settings: CheckpointSettings,
    park_settings: ParkSettings,
    job: JobInfo,
    tmp_path: Path,
    gpu: str,
    pause: str,
) -> None:
    gpufile = tmp_path / "gpu.json"
    await _kill_at(settings, job, gpufile, gpu=gpu, op="park", pause=pause)
    hook = FileGpu(gpufile, with_gpu=gpu == "gpu")
    if gpu == "gpu":
        assert hook.stuck_now() == {job.pid: suspend.GpuState.CHECKPOINTED}
    assert (job.dir / MARKER).exists(), "no crash marker: nothing would recover the job"

    if gpu == "gpu":  # the engine's recover with the GPU stand-in
        assert await _engine(settings, hook).recover(job) is True
    else:  # what a restarted agent runs at start-up
        seen: list[str] = []
        done = await startup.recover_interrupted(settings, lambda j, _s: seen.append(j.name))
        assert done == [job.name] and seen == [job.name]
    assert await _engine(settings, hook).recover(job) is False
    await _runs_again(job, hook, settings.state_dir)
    # and it parks and unparks as before (no lock, marker or record left in the way)
    eng = _engine(settings, hook)
    rec = await core.park(
        job, to="memory", engine=eng, settings=settings, park_settings=park_settings
    )
    assert all(suspend.stopped(p) for p in proctree.tree(job.pid))
    assert rec.gpu_pids == ((job.pid,) if gpu == "gpu" else ())
    await core.unpark(job.name, engine=eng, settings=settings, park_settings=park_settings)
    await _runs_again(job, hook, settings.state_dir)


@pytest.mark.parametrize(
    "pause",
    [
        "gpu:restore",  # the tree continued, GPU state back but still locked
        "step:record",  # running and unlocked, the park record not removed yet
    ],
)
async def test_an_unpark_in_place_killed_midway_is_finished_by_recover(
    settings: CheckpointSettings,
    park_settings: ParkSettings,
    job: JobInfo,
    tmp_path: Path,
    pause: str,
) -> None:
    gpufile = tmp_path / "gpu.json"
    hook = FileGpu(gpufile)
    eng = _engine(settings, hook)
    await core.park(job, to="memory", engine=eng, settings=settings, park_settings=park_settings)
    await _kill_at(settings, job, gpufile, gpu="gpu", op="unpark", pause=pause)
    assert (job.dir / MARKER).exists(), "no crash marker: nothing would finish the unpark"

    assert await _engine(settings, hook).recover(job) is True
    assert await _engine(settings, hook).recover(job) is False
    await _runs_again(job, hook, settings.state_dir)


@pytest.mark.parametrize("to", ["tmpfs", "disk"])
async def test_a_park_to_an_image_killed_midway_leaves_no_partial_image(
    settings: CheckpointSettings,
    park_settings: ParkSettings,
    job: JobInfo,
    tmp_path: Path,
    to: str,
) -> None:
    gpufile = tmp_path / "gpu.json"
    hook = FileGpu(gpufile, with_gpu=False)
    # CRIU has written the image and the tree is frozen; the image is not complete yet
    await _kill_at(settings, job, gpufile, gpu="cpu", op="park", pause="step:capture_files", to=to)
    assert await _engine(settings, hook).recover(job) is True
    await _runs_again(job, hook, settings.state_dir)
    base = park_settings.memory_dir if to == "tmpfs" else StateDir(settings.state_dir).parked_images
    assert (base / job.name).is_dir()  # what the killed park left

    # the next command cleans it: an unpark says "not parked", a park starts afresh
    with pytest.raises(core.ParkError, match="is not parked"):
        await core.unpark(job.name, engine=_engine(settings, hook), settings=settings,
                          park_settings=park_settings)  # fmt: skip
    assert not (base / job.name).exists(), "the partial image was kept"
    await _kill_at(settings, job, gpufile, gpu="cpu", op="park", pause="step:capture_files", to=to)
    assert await _engine(settings, hook).recover(job) is True
    eng = _engine(settings, hook)
    rec = await core.park(job, to=to, engine=eng, settings=settings, park_settings=park_settings)
    assert sorted(p.name for p in base.iterdir()) == [job.name], "a partial image was kept"
    assert not proctree.alive(job.pid)
    done = await core.unpark(job.name, engine=eng, settings=settings, park_settings=park_settings)
    assert proctree.alive(done.pid) and rec.place == to

    # killed once more, and no park or unpark follows: the agent's start-up recovery cleans
    # the partial image of every job (the freeze's marker first: the job runs again)
    (again,) = list_jobs(settings.state_dir)
    await _kill_at(
        settings, again, gpufile, gpu="cpu", op="park", pause="step:capture_files", to=to
    )
    assert (base / job.name).is_dir()
    await startup.recover_interrupted(settings, lambda _j, _s: None, park_settings)
    assert not (base / job.name).exists(), "the agent's start left the partial image"
    assert proctree.alive(again.pid)


def _copies(job: JobInfo) -> list[int]:
    """Processes running the job's init (``spotguard run``'s, naming its directory)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if str(job.dir) in (p.info["cmdline"] or []):
            out.append(p.pid)
    return out


@pytest.mark.parametrize(
    ("to", "pause"),
    [
        ("disk", "criu:post-restore"),  # CRIU restoring the tree: it dies with the unpark
        ("tmpfs", "criu:post-restore"),
        ("disk", "gpu:restore"),  # the tree restored, its GPU state back but still locked
        ("disk", "step:finish"),  # the tree runs; job.json, record and image not updated
    ],
)
async def test_an_unpark_from_an_image_killed_midway_is_undone_or_finished(
    settings: CheckpointSettings,
    park_settings: ParkSettings,
    job: JobInfo,
    tmp_path: Path,
    to: str,
    pause: str,
) -> None:
    gpufile = tmp_path / "gpu.json"
    with_gpu = pause.startswith("gpu:")
    eng = _engine(settings, FileGpu(gpufile, with_gpu=with_gpu))
    rec = await core.park(job, to=to, engine=eng, settings=settings, park_settings=park_settings)
    gpufile.unlink(missing_ok=True)  # the parked processes are gone, and their GPU state
    hook = FileGpu(gpufile, with_gpu=with_gpu)
    await _kill_at(
        settings, job, gpufile, gpu="gpu" if with_gpu else "cpu", op="unpark", pause=pause
    )
    assert (job.dir / MARKER).exists(), "no crash marker: nothing would clean the unpark up"
    image = Path(rec.location)

    if pause.startswith("criu:"):
        assert _copies(job), "CRIU left nothing behind here"  # the half-restored tree
        # the next unpark kills what CRIU left, then restores the job: one copy runs
        done = await core.unpark(
            job.name, engine=_engine(settings, hook), settings=settings, park_settings=park_settings
        )
        assert _copies(job) == [done.pid]
    else:
        assert await _engine(settings, hook).recover(job) is True
        assert await _engine(settings, hook).recover(job) is False
    now = resolve_job(job.name, state_dir=settings.state_dir)
    await _runs_again(now, hook, settings.state_dir)
    assert _copies(now) == [now.pid]
    assert not await asyncio.to_thread(image.exists), "the parked image was kept"
