"""Failure at any step of a freeze leaves the job running, unfrozen and GPU-unlocked."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from ckpt_helpers import DEMO, Launch, lines, proc_state, progresses, wait_for

from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import FREEZE_STEPS, Engine, Mode
from spotguard.checkpoint.meta import META_NAME
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectoryTarget
from spotguard.checkpoint.testing import RecordingGpu
from spotguard.errors import CheckpointError, GpuError, StepTimeout

pytestmark = pytest.mark.criu

LONG = [*DEMO, "--steps", "100000", "--step-seconds", "0.02"]


class FailAt:
    """Faults: raise (or wait forever) before one named step."""

    def __init__(self, step: str, *, hang: bool = False) -> None:
        self.step = step
        self.hang = hang
        self.reached = asyncio.Event()

    async def before(self, step: str) -> None:
        if step != self.step:
            return
        self.reached.set()
        if self.hang:
            await asyncio.sleep(3600)
        raise CheckpointError(f"injected failure before {step}")


async def assert_running_and_unlocked(pid: int, stdout: Path, gpu: RecordingGpu) -> None:
    assert proctree.alive(pid)
    assert all(proc_state(p) not in ("T", "t") for p in proctree.tree(pid))
    assert gpu.stuck() == {}
    await progresses(stdout)


def _cases() -> list[tuple[str, Mode]]:
    out = [(s, Mode.RESUME) for s in FREEZE_STEPS]
    resume_only = ("gpu_restore", "gpu_unlock", "nccl_rebuild")
    out += [(s, Mode.EXIT) for s in FREEZE_STEPS if s not in resume_only]
    return out


@pytest.mark.parametrize(("step", "mode"), _cases())
async def test_failure_before_each_step_resumes_the_job(
    step: str,
    mode: Mode,
    settings: CheckpointSettings,
    criu_bin: str,
    launch: Launch,
    tmp_path: Path,
) -> None:
    job = await launch(LONG, f"fail-{step.replace('_', '-')}-{mode}")
    await wait_for(lambda: len(lines(job.dir / "stdout")) > 2, "first steps")
    gpu = RecordingGpu()
    engine = Engine(Criu(criu_bin), gpu, settings=settings, faults=FailAt(step))
    target = tmp_path / "img"
    with pytest.raises(CheckpointError, match=f"injected failure before {step}"):
        await engine.freeze(job, DirectoryTarget(target), mode)
    await assert_running_and_unlocked(job.pid, job.dir / "stdout", gpu)
    assert not (target / META_NAME).exists()
    assert not (job.dir / "operation.json").exists()
    if step not in ("scan", "nccl_release", "gpu_lock"):
        assert ("lock", job.pid) in gpu.calls


@pytest.mark.parametrize("op", ["lock", "checkpoint", "restore", "unlock"])
async def test_gpu_call_failure_resumes_the_job(
    op: str, settings: CheckpointSettings, criu_bin: str, launch: Launch, tmp_path: Path
) -> None:
    job = await launch(LONG, f"gpufail-{op}")
    await wait_for(lambda: len(lines(job.dir / "stdout")) > 2, "first steps")
    gpu = RecordingGpu(fail_on=op)
    engine = Engine(Criu(criu_bin), gpu, settings=settings)
    with pytest.raises(GpuError, match=f"injected failure in GPU {op}"):
        await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.RESUME)
    await assert_running_and_unlocked(job.pid, job.dir / "stdout", gpu)


async def test_cancellation_while_frozen_resumes_the_job(
    settings: CheckpointSettings, criu_bin: str, launch: Launch, tmp_path: Path
) -> None:
    job = await launch(LONG, "cancelled")
    await wait_for(lambda: len(lines(job.dir / "stdout")) > 2, "first steps")
    gpu = RecordingGpu()
    faults = FailAt("capture_files", hang=True)
    engine = Engine(Criu(criu_bin), gpu, settings=settings, faults=faults)
    task = asyncio.create_task(engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT))
    await asyncio.wait_for(faults.reached.wait(), 30)
    assert all(proc_state(p) in ("T", "t") for p in proctree.tree(job.pid)), "not frozen"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_running_and_unlocked(job.pid, job.dir / "stdout", gpu)


class _SlowAbort(DirectoryTarget):
    """A target whose abort takes a second (a store slow to answer), and says when it starts."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.aborting = asyncio.Event()

    async def abort(self) -> None:
        self.aborting.set()
        await asyncio.sleep(1)
        await super().abort()


async def test_a_second_cancellation_while_the_freeze_is_undone_still_unlocks_the_job(
    settings: CheckpointSettings, criu_bin: str, launch: Launch, tmp_path: Path
) -> None:
    """A caller that cancels again (a second Ctrl-C, a supervisor's timeout) while a
    cancelled freeze is being undone must not stop the undoing half-way: the GPU is unlocked
    and the tree continued all the same."""
    job = await launch(LONG, "twice")
    await wait_for(lambda: len(lines(job.dir / "stdout")) > 2, "first steps")
    gpu = RecordingGpu()
    faults = FailAt("capture_files", hang=True)
    engine = Engine(Criu(criu_bin), gpu, settings=settings, faults=faults)
    target = _SlowAbort(tmp_path / "img")
    task = asyncio.create_task(engine.freeze(job, target, Mode.EXIT))
    await asyncio.wait_for(faults.reached.wait(), 30)
    task.cancel()
    await asyncio.wait_for(target.aborting.wait(), 30)  # in the failure path: cancelled again
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: gpu.stuck() == {}, "the GPU to be unlocked", 30)
    await assert_running_and_unlocked(job.pid, job.dir / "stdout", gpu)


async def test_criu_timeout_is_a_step_timeout_and_resumes_the_job(
    state_dir: Path, criu_bin: str, launch: Launch, tmp_path: Path
) -> None:
    settings = CheckpointSettings(state_dir=state_dir, criu=criu_bin, criu_timeout=1.0)
    job = await launch(LONG, "slow")
    await wait_for(lambda: len(lines(job.dir / "stdout")) > 2, "first steps")
    gpu = RecordingGpu()
    engine = Engine(
        Criu(criu_bin), gpu, settings=settings, faults=FailAt("capture_files", hang=True)
    )
    with pytest.raises(StepTimeout, match="criu dump ran past"):
        await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
    await assert_running_and_unlocked(job.pid, job.dir / "stdout", gpu)


FREEZER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from spotguard.checkpoint.criu import Criu
    from spotguard.checkpoint.engine import Engine, Mode
    from spotguard.checkpoint.jobs import resolve_job
    from spotguard.checkpoint.settings import CheckpointSettings
    from spotguard.checkpoint.staging import DirectoryTarget

    class Hang:
        async def before(self, step):
            if step == "capture_files":
                print("frozen", flush=True)
                await asyncio.sleep(3600)

    async def main():
        s = CheckpointSettings(state_dir=Path(sys.argv[1]), criu=sys.argv[2])
        job = resolve_job(sys.argv[3], state_dir=s.state_dir)
        await Engine(Criu(s.criu), settings=s, faults=Hang()).freeze(
            job, DirectoryTarget(Path(sys.argv[4])), Mode.EXIT)

    asyncio.run(main())
    """
)


async def test_kill_9_mid_freeze_then_recover(
    engine: Engine, state_dir: Path, criu_bin: str, launch: Launch, tmp_path: Path
) -> None:
    job = await launch(LONG, "killed-agent")
    await wait_for(lambda: len(lines(job.dir / "stdout")) > 2, "first steps")
    freezer = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        FREEZER,
        str(state_dir),
        criu_bin,
        job.name,
        str(tmp_path / "img"),
        stdout=asyncio.subprocess.PIPE,
    )
    assert freezer.stdout is not None
    line = await asyncio.wait_for(freezer.stdout.readline(), 30)
    assert line.strip() == b"frozen"
    assert (job.dir / "operation.json").exists()
    assert all(proc_state(p) in ("T", "t") for p in proctree.tree(job.pid))
    os.kill(freezer.pid, signal.SIGKILL)
    await freezer.wait()
    assert await engine.recover(job) is True
    assert not (job.dir / "operation.json").exists()
    assert await engine.recover(job) is False
    await assert_running_and_unlocked(job.pid, job.dir / "stdout", RecordingGpu())


KILLED_IN_POST_DUMP = """
import asyncio, pathlib, subprocess, sys
from spotguard.checkpoint.criu import Criu

async def main() -> None:
    job = subprocess.Popen(["setsid", "sleep", "600"])
    await asyncio.sleep(0.2)
    here = pathlib.Path(sys.argv[2])

    async def frozen() -> None:  # the engine's post-dump work: it never ends here
        (here / "frozen").touch()
        await asyncio.sleep(3600)

    (here / "job.pid").write_text(str(job.pid))
    await Criu(sys.argv[1]).dump(job.pid, here / "img", leave_running=True, on_frozen=frozen)

asyncio.run(main())
"""


def test_a_process_killed_while_criu_waits_in_post_dump_leaves_no_action_script(
    criu_bin: str, tmp_path: Path
) -> None:
    """The process that runs CRIU (an agent, ``spotguard checkpoint``) is killed while CRIU's
    post-dump action script waits for its answer: the script sees its owner gone and ends
    (CRIU resumes the tree and exits); it must not wait on the answer's FIFO for ever (an
    orphaned ``/bin/sh …/action.sh`` per kill)."""
    (tmp_path / "img").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the hook's FIFOs and script under here
    runner = subprocess.Popen([sys.executable, "-c", KILLED_IN_POST_DUMP, criu_bin,
                               str(tmp_path)], env=env)  # fmt: skip
    job = 0
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "frozen").exists():
            assert runner.poll() is None and time.monotonic() < deadline, "no post-dump"
            time.sleep(0.05)
        job = int((tmp_path / "job.pid").read_text())
        runner.kill()
        runner.wait()

        def scripts() -> list[int]:
            found = []
            for proc in Path("/proc").iterdir():
                with contextlib.suppress(OSError):
                    if proc.name.isdigit() and str(tmp_path) in (proc / "cmdline").read_text():
                        found.append(int(proc.name))
            return found

        deadline = time.monotonic() + 10
        while scripts() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert scripts() == [], "CRIU's action script outlived the process that ran CRIU"
    finally:
        if runner.poll() is None:
            runner.kill()
        if job:
            with contextlib.suppress(ProcessLookupError):
                os.kill(job, signal.SIGKILL)


def test_crius_action_script_never_outlives_criu(tmp_path: Path) -> None:
    """CRIU's post-dump action script, run with nobody on the other end of its FIFOs (the
    process that ran CRIU gone, or its hook already closed), exits once its parent — CRIU —
    has gone, instead of waiting in the FIFO's open for ever (seen in CI: two orphaned
    ``/bin/sh …/action.sh`` after the agent-kill tests)."""
    from spotguard.checkpoint.criuhook import _ACTION_SCRIPT

    script = tmp_path / "action.sh"
    script.write_text(_ACTION_SCRIPT)
    script.chmod(0o700)
    req, ack = tmp_path / "req", tmp_path / "ack"
    os.mkfifo(req)
    os.mkfifo(ack)
    env = {**os.environ, "CRTOOLS_SCRIPT_ACTION": "post-dump",
           "SPOTGUARD_HOOK_REQ": str(req), "SPOTGUARD_HOOK_ACK": str(ack)}  # fmt: skip
    # a stand-in for CRIU: starts the script, then dies (SIGKILL) a moment later
    criu = subprocess.Popen(["sh", "-c", f'"{script}" & echo $!; sleep 0.3; kill -9 $$'],
                            env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert criu.stdout is not None
    pid = int(criu.stdout.readline())
    criu.wait()
    deadline = time.monotonic() + 5
    while proctree.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = proctree.alive(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the action script outlived its CRIU"
