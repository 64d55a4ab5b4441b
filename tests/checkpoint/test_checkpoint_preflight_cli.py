"""Restore preflight refuses mismatches naming both sides; the CLI commands end to end."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from ckpt_helpers import DEMO, Launch, lines, wait_exit, wait_for

from sgtest import sg_env
from spotguard.checkpoint import proctree, seal
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.cuda import NoGpu, inventory
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import resolve_job
from spotguard.checkpoint.meta import META_NAME
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.checkpoint.testing import RecordingGpu
from spotguard.errors import MismatchError, PreflightError
from spotguard.facts import GpuDevice, GpuInventory

pytestmark = pytest.mark.criu


async def _image(engine: Engine, launch: Launch, tmp_path: Path, name: str) -> Path:
    job = await launch([*DEMO, "--steps", "1000", "--step-seconds", "0.05"], name)
    await wait_for(lambda: len(lines(job.dir / "stdout")) > 1, "first step")
    result = await engine.freeze(job, DirectoryTarget(tmp_path / name), Mode.RESUME)
    return result.images_dir


def _edit(images: Path, **changes: object) -> None:
    """The image as another host would have written it: its metadata changed, then sealed
    again (local images are sealed under the host's key and refused when altered)."""
    meta = json.loads((images / META_NAME).read_text())
    meta.update(changes)
    (images / META_NAME).write_text(json.dumps(meta))
    seal.seal(images, seal.HostKey.default())


async def test_newer_criu_in_image_is_refused_naming_both_versions(
    engine: Engine, launch: Launch, tmp_path: Path
) -> None:
    images = await _image(engine, launch, tmp_path, "criu-mismatch")
    _edit(images, criu_version="99.1")
    with pytest.raises(MismatchError, match=r"image has '99.1', this host has '4\.") as err:
        await engine.restore(DirectorySource(images))
    assert err.value.image_side == "99.1"


async def test_gpu_model_and_count_mismatch_and_missing_api(
    settings: CheckpointSettings, criu_bin: str, launch: Launch, tmp_path: Path
) -> None:
    engine = Engine(Criu(criu_bin), RecordingGpu(), settings=settings)
    images = await _image(engine, launch, tmp_path, "gpu-mismatch")
    other = GpuInventory(
        (GpuDevice(0, "GPU-00000000-0000-0000-0000-0000000000aa", "Other GPU", 1 << 30),),
        "580.1.2",
    )
    for gpu, pattern in (
        (RecordingGpu(inventory=other), "GPU model mismatch: image has 'Fake GPU 1GB'"),
        (RecordingGpu(inventory=GpuInventory()), "GPU model mismatch"),
    ):
        with pytest.raises(MismatchError, match=pattern):
            await Engine(Criu(criu_bin), gpu, settings=settings).restore(DirectorySource(images))
    with pytest.raises(PreflightError, match="no usable NVIDIA driver checkpoint API"):
        await Engine(Criu(criu_bin), NoGpu(), settings=settings).restore(DirectorySource(images))


async def test_restore_refuses_a_job_that_is_running_here(
    engine: Engine, launch: Launch, tmp_path: Path
) -> None:
    images = await _image(engine, launch, tmp_path, "twice")
    with pytest.raises(PreflightError, match="already running here"):
        await engine.restore(DirectorySource(images))


def test_inventory_without_gpu_is_empty_not_a_crash() -> None:
    inv = inventory()
    assert inv.count == len(inv.devices)


async def test_cli_run_checkpoint_restore_and_doctor(
    criu_bin: str, state_dir: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "SPOTGUARD_STATE_DIR": str(state_dir), "SPOTGUARD_CRIU": criu_bin}
    # 15 s of steps: at 4.5 s a loaded CI machine's `spotguard checkpoint` found it ended
    out = sg_env("run", "--json", "--name", "cli-job", "--", *DEMO, "--steps", "150",
               "--step-seconds", "0.1", env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    started = json.loads(out.stdout)
    assert started["job"] == "cli-job" and proctree.alive(started["pid"])
    job = resolve_job("cli-job", state_dir=state_dir)
    assert resolve_job(str(started["pid"]), state_dir=state_dir) == job
    await wait_for(lambda: len(lines(job.dir / "stdout")) > 3, "first steps")
    out = sg_env("checkpoint", "cli-job", "--to", str(tmp_path / "img"), "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["mode"] == "exit"
    await wait_for(lambda: not proctree.alive(started["pid"]), "the job to stop")
    out = sg_env("restore", str(tmp_path / "img"), "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert await wait_exit(resolve_job("cli-job", state_dir=state_dir)) == 0
    assert lines(job.dir / "stdout")[-1].startswith("done checksum")

    bad = sg_env("checkpoint", "no-such-job", "--to", str(tmp_path / "x"), env=env)
    assert bad.returncode == 1 and "no job" in bad.stderr and "Traceback" not in bad.stderr
    doc = sg_env("doctor", "--json", env=env)
    checks = {c["name"]: c for c in json.loads(doc.stdout)}
    assert checks["criu"]["ok"] and "4." in checks["criu"]["found"]
    assert doc.returncode == 0


async def test_run_and_checkpoint_refuse_what_cannot_work_before_the_job_is_touched(
    criu_bin: str, state_dir: Path, tmp_path: Path
) -> None:
    """Bad input is one typed line (exit 2) before anything happens: ``run`` of a command
    that does not exist (it said "started" and the job died at its exec with 127), and
    ``checkpoint --to`` a file or a directory that cannot be made (an unexpected
    NotADirectoryError, or the job frozen before the error). The job runs on untouched."""
    env = {**os.environ, "SPOTGUARD_STATE_DIR": str(state_dir), "SPOTGUARD_CRIU": criu_bin}
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    for cmd, says in [
        ([str(tmp_path / "no-such-cmd")], "no such file"),
        (["no-such-cmd-anywhere"], "no such command on the job's PATH"),
        ([str(a_file)], "not an executable file"),
    ]:
        bad = sg_env("run", "--name", "never", "--", *cmd, env=env)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        [said] = bad.stderr.strip().splitlines()
        assert said.startswith(f"spotguard: error: cannot run {cmd[0]!r}: {says}"), said
        assert not (state_dir / "jobs" / "never").exists()

    out = sg_env("run", "--json", "--name", "runs-on", "--", *DEMO, "--steps", "10000",
                 "--step-seconds", "0.05", env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    job = resolve_job("runs-on", state_dir=state_dir)
    try:
        await wait_for(lambda: len(lines(job.dir / "stdout")) > 3, "first steps")
        for to, says in [
            (a_file, f"{a_file} is not a directory"),
            (Path("/proc/no-such-dir"), "cannot make /proc/no-such-dir for the image"),
        ]:
            bad = sg_env("checkpoint", "runs-on", "--to", str(to), env=env)
            assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
            last = bad.stderr.strip().splitlines()[-1]
            assert last.startswith("spotguard: error:") and says in last, bad.stderr
        assert a_file.read_text() == "not a directory\n"
        n = len(lines(job.dir / "stdout"))
        await wait_for(lambda: len(lines(job.dir / "stdout")) > n + 3, "steps after the refusals")
    finally:
        proctree.signal_all([job.pid], signal.SIGKILL)
