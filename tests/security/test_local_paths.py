"""A local user against the paths spotguard writes as root: staging, the state directory, a
job's files and the images' metadata (issue cases 1, 3 and 7's `spotguard run`).

Each test has a real unprivileged user (``attacker``) act through ``runuser`` on real files;
each failed on the code before the fix (docs/security.md, "A local user")."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from sec_helpers import Attacker

from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.meta import ImageMeta
from spotguard.checkpoint.staging import DirectoryTarget
from spotguard.errors import UnsafePath
from spotguard.facts import GpuInventory, HostFacts
from spotguard.modes import Mode


def test_a_staging_root_another_user_created_first_is_refused(
    attacker: Attacker, shm_world: Path, world: Path
) -> None:
    """Nothing creates /dev/shm/spotguard at boot: a user who creates it first would own
    every staged image under it. The freeze refuses it in one line instead."""
    shm_world.mkdir()
    root = shm_world / "spotguard"
    shm_world.chmod(0o1777)
    attacker.run("mkdir", "-m", "0777", str(root))
    target = DirectoryTarget(shm_root=root, disk_root=world / "disk", margin=0)
    with pytest.raises(UnsafePath, match=r"belongs to uid \d+, not to spotguard") as err:
        asyncio.run(target.start("j1", 1))
    assert "\n" not in str(err.value)
    assert list(root.iterdir()) == []  # nothing of the job went there


def test_staged_images_are_private_to_root(
    attacker: Attacker, shm_world: Path, world: Path
) -> None:
    """CRIU writes its files 0644: the staging root and the image directory are 0700, so no
    other user reads the job's memory while it waits for its upload."""
    root = shm_world / "spotguard"
    target = DirectoryTarget(shm_root=root, disk_root=world / "disk", margin=0)
    asyncio.run(target.start("j1", 1))
    pages = target.images_dir / "pages-1.img"
    pages.write_bytes(b"the job's memory")
    pages.chmod(0o644)  # as CRIU leaves them
    for d in (root, target.images_dir):
        st = d.stat()
        assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700, d
    res = attacker.run("cat", str(pages), check=False)
    assert res.returncode != 0 and "memory" not in res.stdout
    res = attacker.run("ls", str(target.images_dir), check=False)
    assert res.returncode != 0


def test_a_staging_root_swapped_for_a_symlink_is_refused(attacker: Attacker, world: Path) -> None:
    """A user who can write the parent of the staging root puts a link there, to a directory
    of theirs: refused (the walk never follows a link)."""
    parent = world / "shm"
    parent.mkdir(mode=0o1777)
    parent.chmod(0o1777)
    mine = world / "attacker-dir"
    attacker.run("mkdir", "-m", "0777", str(world / "attacker-dir"), check=False)
    if not mine.exists():  # world is root's 0755: make it for the attacker
        mine.mkdir()
        os.chown(mine, attacker.uid, attacker.gid)
    attacker.run("ln", "-s", str(mine), str(parent / "spotguard"))
    target = DirectoryTarget(shm_root=parent / "spotguard", disk_root=world / "disk", margin=0)
    with pytest.raises(UnsafePath, match="symlink"):
        asyncio.run(target.start("j1", 1))
    assert list(mine.iterdir()) == []


def _root_only_secret(world: Path) -> Path:
    vault = world / "vault"
    vault.mkdir(mode=0o700)
    secret = vault / "shadow"
    secret.write_text("root:SECRET\n")
    secret.chmod(0o600)
    return secret


def test_job_json_is_never_written_through_a_link(attacker: Attacker, world: Path) -> None:
    """Root writes ``job.json`` into the job's directory; a user able to write that
    directory plants links at the file's name and at the temporary name root used: neither
    is followed, the root-only file stays as it was."""
    secret = _root_only_secret(world)
    jobdir = world / "state" / "jobs" / "j1"
    jobdir.mkdir(parents=True)
    os.chown(jobdir, attacker.uid, attacker.gid)
    for name in (".job.json.tmp", "job.json"):
        attacker.run("ln", "-s", str(secret), str(jobdir / name))
    JobInfo("j1", 4242, jobdir).save()
    assert secret.read_text() == "root:SECRET\n"
    assert not (jobdir / "job.json").is_symlink()
    assert json.loads((jobdir / "job.json").read_text())["pid"] == 4242
    assert stat.S_IMODE((jobdir / "job.json").stat().st_mode) == 0o600


def test_image_metadata_is_never_written_through_a_link(attacker: Attacker, world: Path) -> None:
    """The same for ``spotguard-image.json`` in an images directory a user can write."""
    secret = _root_only_secret(world)
    images = world / "img"
    images.mkdir()
    os.chown(images, attacker.uid, attacker.gid)
    for name in (".spotguard-image.json.tmp", "spotguard-image.json"):
        attacker.run("ln", "-s", str(secret), str(images / name))
    meta = ImageMeta(
        job={"name": "j1", "pid": 1, "dir": "/x/jobs/j1"},
        mode=Mode.EXIT,
        criu_version="4.2",
        host=HostFacts.probe("4.2"),
        gpu=GpuInventory.from_json(None),
        gpu_processes=[],
        root_ns_pid=1,
        pids=[1],
        staging={},
        timeline=[],
    )
    meta.write(images)
    assert secret.read_text() == "root:SECRET\n"
    assert ImageMeta.read(images).job["name"] == "j1"


def test_spotguard_run_keeps_its_state_dir_and_the_jobs_output_private(
    attacker: Attacker, world: Path
) -> None:
    """``spotguard run`` makes its state dir 0700 and the job's output 0600: another user
    reads neither the job's files nor its output."""
    state = world / "state"
    cfg = world / "sg.toml"
    cfg.write_text(f'[checkpoint]\nstate_dir = "{state}"\n')
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotguard",
            "--config",
            str(cfg),
            "run",
            "--name",
            "j1",
            "--json",
            "--",
            "sh",
            "-c",
            "echo the-output; sleep 60",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    info = json.loads((state / "jobs" / "j1" / "job.json").read_text())
    try:
        out = state / "jobs" / "j1" / "stdout"
        for _ in range(100):
            if out.exists() and out.read_text():
                break
            import time

            time.sleep(0.05)
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert stat.S_IMODE((state / "jobs" / "j1").stat().st_mode) == 0o700
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
        assert stat.S_IMODE((state / "jobs" / "j1" / "job.json").stat().st_mode) == 0o600
        res = attacker.run("cat", str(out), check=False)
        assert res.returncode != 0 and "the-output" not in res.stdout
    finally:
        os.kill(int(info["pid"]), signal.SIGKILL)


def test_a_job_link_is_followed_only_where_only_root_could_have_made_it(
    attacker: Attacker, world: Path
) -> None:
    """A job restored from another host's directory is found under this state dir through the
    link ``link_job_dir`` makes. Such a link is followed in a jobs directory only root can
    write; the same link in a directory another user can write (or a link the user owns) is
    never followed."""
    from spotguard.checkpoint.jobs import link_job_dir, resolve_job
    from spotguard.errors import JobError

    elsewhere = world / "vm1" / "jobs" / "j1"
    elsewhere.mkdir(parents=True)
    elsewhere.parent.parent.chmod(0o700)
    JobInfo("j1", 4242, elsewhere).save()
    state = world / "vm2"
    link_job_dir(JobInfo("j1", 4242, elsewhere), state)
    jobs = state / "jobs"
    jobs.chmod(0o700)
    assert resolve_job("j1", state_dir=state).pid == 4242
    jobs.chmod(0o777)  # another user could have put the link there
    with pytest.raises(JobError, match="symlink"):
        resolve_job("j1", state_dir=state)
    jobs.chmod(0o700)
    (jobs / "j1").unlink()
    os.chown(jobs, attacker.uid, attacker.gid)
    attacker.run("ln", "-s", str(elsewhere), str(jobs / "j1"))
    os.chown(jobs, 0, 0)
    with pytest.raises(JobError, match="symlink"):
        resolve_job("j1", state_dir=state)


def test_a_jobs_output_is_never_written_through_a_link(attacker: Attacker, world: Path) -> None:
    """A user who can write a job's directory plants links at ``stdout`` and ``stderr``, to a
    root-only file, and the job is started there (its output is appended as root): the job
    directory is refused (not root's); links left in a directory of root's are not followed
    either (``O_NOFOLLOW``): the start fails in one line, before anything runs. Nothing is
    written through a link; the root-only file stays as it was."""
    from spotguard.checkpoint.jobs import start_job
    from spotguard.errors import JobError

    secret = _root_only_secret(world)
    state = world / "state"
    jobdir = state / "jobs" / "j1"
    jobdir.mkdir(parents=True, mode=0o700)
    os.chown(jobdir, attacker.uid, attacker.gid)
    for d in (state, state / "jobs"):
        d.chmod(0o755)  # reachable while the user plants (as an earlier build left them)
    argv = ["sh", "-c", "echo PWNED; echo PWNED >&2"]
    for name in ("stdout", "stderr"):
        attacker.run("ln", "-s", str(secret), str(jobdir / name))
    for d in (state, state / "jobs"):
        d.chmod(0o700)
    with pytest.raises(UnsafePath, match="belongs to uid"):
        asyncio.run(start_job(argv, "j1", state_dir=state))
    assert secret.read_text() == "root:SECRET\n"
    os.chown(jobdir, 0, 0)  # root's now, the links still in it
    with pytest.raises(JobError, match="cannot write the job's output") as failed:
        asyncio.run(start_job(argv, "j1", state_dir=state))
    assert "\n" not in str(failed.value)
    assert not (jobdir / "job.json").exists()
    assert secret.read_text() == "root:SECRET\n"
    assert all((jobdir / n).is_symlink() for n in ("stdout", "stderr"))
