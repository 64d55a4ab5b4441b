"""The freeze engine on real jobs with real CRIU: jobs continue exactly after restore."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ckpt_helpers import DEMO, Launch, lines, progresses, wait_exit, wait_for

from spotguard.checkpoint import proctree
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.meta import META_NAME, ImageMeta
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget

pytestmark = pytest.mark.criu

STEPS = ["--steps", "60", "--step-seconds", "0.02"]
#: a job that outlives two freezes in a row on a loaded machine (60 steps, 1.2 s, ended
#: between them on the CI machine: the second dump found its process exiting)
LONG_STEPS = ["--steps", "240", "--step-seconds", "0.02"]


def reference_output(steps: list[str] = STEPS) -> list[str]:
    """The demo job's output when nothing interrupts it."""
    out = subprocess.run(
        [*DEMO, *steps[:2], "--step-seconds", "0"], capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


async def test_leave_running_then_exit_then_restore_matches_uninterrupted_run(
    engine: Engine, launch: Launch, tmp_path: Path
) -> None:
    job = await launch([*DEMO, *LONG_STEPS], "calc")
    stdout = job.dir / "stdout"
    await wait_for(lambda: len(lines(stdout)) > 10, "first steps")

    first = await engine.freeze(job, DirectoryTarget(tmp_path / "img-a"), Mode.RESUME)
    assert proctree.alive(job.pid)
    await progresses(stdout)
    assert [s.name for s in first.timeline.steps if s.name != "staging"] == [
        "scan",
        "nccl_release",  # no process with the NCCL shim: nothing released
        "criu_dump",
        "cpu_pages",  # no mapping large enough: nothing carried beside CRIU
        "capture_files",
        "nccl_rebuild",
        "finish",
    ]
    meta = ImageMeta.read(first.images_dir)
    assert meta.mode == "resume" and meta.root_ns_pid == 1 and meta.timeline

    second = await engine.freeze(job, DirectoryTarget(tmp_path / "img-b"), Mode.EXIT)
    await wait_for(lambda: not proctree.alive(job.pid), "the job to be stopped")
    frozen_at = len(lines(stdout))
    assert frozen_at < 242, "the job had already finished; the test proves nothing"

    # the machine is gone: its job directory with it
    shutil.rmtree(job.dir)
    restored = await engine.restore(DirectorySource(second.images_dir))
    assert restored.pid != job.pid
    assert await wait_exit(restored.job) == 0
    assert lines(stdout) == reference_output(LONG_STEPS)
    assert not (job.dir / "operation.json").exists()


async def test_restore_leave_running_image_after_original_finished(
    engine: Engine, launch: Launch, tmp_path: Path
) -> None:
    job = await launch([*DEMO, *STEPS], "rollback")
    stdout = job.dir / "stdout"
    await wait_for(lambda: len(lines(stdout)) > 5, "first steps")
    result = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.RESUME)
    assert await wait_exit(job) == 0  # and its init ended: the restore is of a finished job
    (job.dir / "exit_status").unlink()
    restored = await engine.restore(DirectorySource(result.images_dir))
    assert await wait_exit(restored.job) == 0
    assert lines(stdout) == reference_output()


PARENT_CHILD = textwrap.dedent(
    """
    import os, sys, time
    n = int(sys.argv[1])
    pid = os.fork()
    who = "child" if pid == 0 else "parent"
    log = open(f"{who}.log", "a")          # append-only log in the working directory
    state = open(f"{who}.state", "w+")     # a file rewritten in place
    for i in range(1, n + 1):
        log.write(f"{who} {i}\\n"); log.flush()
        state.seek(0); state.write(f"{i:08d}"); state.flush()
        time.sleep(0.02)
    if pid:
        _, status = os.waitpid(pid, 0)
        print("parent done, child status", status, flush=True)
    """
)


async def test_parent_child_and_open_files_survive_a_move(
    engine: Engine, launch: Launch, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    script = tmp_path / "pc.py"
    script.write_text(PARENT_CHILD)
    job = await launch([sys.executable, str(script), "80"], "family", cwd=work)
    await wait_for(lambda: len(lines(work / "child.log")) > 10, "the child to log")
    assert len(proctree.tree(job.pid)) == 3  # init, parent, child

    result = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
    await wait_for(lambda: not proctree.alive(job.pid), "the job to be stopped")
    carried = {Path(f.path).name for f in ImageMeta.read(result.images_dir).files}
    assert {"child.log", "parent.log", "child.state", "parent.state", "stdout"} <= carried

    # another machine: neither the working files nor the job directory exist there
    shutil.rmtree(work)
    shutil.rmtree(job.dir)
    restored = await engine.restore(DirectorySource(result.images_dir))
    assert await wait_exit(restored.job) == 0
    for who in ("parent", "child"):
        assert lines(work / f"{who}.log") == [f"{who} {i}" for i in range(1, 81)]
        assert (work / f"{who}.state").read_text() == f"{80:08d}"
    assert lines(job.dir / "stdout") == ["parent done, child status 0"]


async def test_checkpoint_of_a_finished_job_is_a_typed_error(
    engine: Engine, launch: Launch, tmp_path: Path
) -> None:
    job = await launch([sys.executable, "-c", "pass"], "short")
    await wait_exit(job)
    await wait_for(lambda: not proctree.alive(job.pid), "the init to end")
    from spotguard.errors import JobError

    with pytest.raises(JobError, match="not running"):
        await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)


async def test_meta_records_timeline_and_staging(
    engine: Engine, launch: Launch, tmp_path: Path
) -> None:
    job = await launch([*DEMO, "--steps", "1000", "--step-seconds", "0.05"], "meta")
    await wait_for(lambda: len(lines(job.dir / "stdout")) > 1, "first step")
    target = DirectoryTarget(shm_root=tmp_path / "shm", disk_root=tmp_path / "disk")
    result = await engine.freeze(job, target, Mode.RESUME)
    data = json.loads((result.images_dir / META_NAME).read_text())
    assert data["staging"]["mode"] == "tmpfs"
    assert result.images_dir.parent == tmp_path / "shm"
    assert {s["name"] for s in data["timeline"]} >= {"scan", "criu_dump", "capture_files"}
    assert data["criu_version"].startswith(("4.", "5."))
    await asyncio.sleep(0)
