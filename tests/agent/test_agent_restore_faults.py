"""Fault cases of a restore on boot (docs/operations.md, the fault table): a real agent given
an assignment, real CRIU images in a real ``file://`` store, real filesystems that fill up.

* a corrupt, missing or swapped chunk (streamed and staged images) is refused before any file
  of the job is written or CRIU starts: ``restore_failed`` with ``image_corrupt``, not
  retryable, the image at fault;
* a disk that fills up during the restore (the staging place, or the whole state dir): the
  agent reports ``restore_failed`` and keeps running — never a traceback.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import pytest
from agent_helpers import EventSink, Host, job_argv, running_agent, wait_until

from sgtest import flip_a_byte
from spotguard import operations
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.contracts import Assignment, Mode, chunk_key
from spotguard.image import ImageReader, ImageSettings, Manifest
from spotguard.statedir import StateDir

pytestmark = pytest.mark.criu

PAGE = 4096
SHORT_JOB = job_argv("--steps", "400", "--step-seconds", "0.05", "--mb", "4", "--gpu", "no")


@contextmanager
def tmpfs(where: Path, size: int) -> Iterator[Path]:
    """A fresh tmpfs of ``size`` bytes mounted at ``where`` (a small disk that can fill up)."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(where: Path) -> None:
    """Write to ``where`` until its filesystem has no byte left."""
    with (where / "filler").open("wb", buffering=0) as f:
        for block in (1 << 20, PAGE, 1):
            while _wrote(f, block):
                pass
    assert os.statvfs(where).f_bavail == 0


def _wrote(f: BinaryIO, n: int) -> bool:
    """Whether ``n`` more bytes fitted (False once the filesystem is full)."""
    try:
        f.write(b"\0" * n)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        return False
    return True


async def exit_image(host: Host, store: str, stream: str) -> tuple[str, JobInfo]:
    """An exit image of a fresh sample job (the job is stopped by it), and the job."""
    job = await start_job(SHORT_JOB, "train", state_dir=host.state)
    result = await operations.checkpoint(
        job,
        store,
        mode=Mode.EXIT,
        settings=host.checkpoint_settings(stream=stream),
        image_settings=ImageSettings(),
    )
    assert not proctree.alive(job.pid)
    return result.image_url, job


async def manifest_of(image_url: str) -> Manifest:
    async with ImageReader(image_url, settings=ImageSettings()) as reader:
        return reader.manifest


def _pages_chunks(m: Manifest) -> tuple[str, str]:
    """The last chunk of the largest memory file, and a chunk of another file."""
    pages = max((f for f in m.files if f.name.startswith("pages-")), key=lambda f: f.size)
    victim = pages.chunks[-1].digest
    other = next(c.digest for f in m.files for c in f.chunks if c.digest != victim)
    return victim, other


def corrupt(root: Path, job: str, victim: str, other: str) -> None:
    flip_a_byte(root / chunk_key(job, victim))


def missing(root: Path, job: str, victim: str, other: str) -> None:
    (root / chunk_key(job, victim)).unlink()


def swapped(root: Path, job: str, victim: str, other: str) -> None:
    a, b = root / chunk_key(job, victim), root / chunk_key(job, other)
    blob_a, blob_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(blob_b)
    b.write_bytes(blob_a)


DAMAGES: dict[str, Callable[[Path, str, str, str], None]] = {
    "corrupt": corrupt,
    "missing": missing,
    "swapped": swapped,
}


def new_vm(tmp_path: Path, name: str, criu: str) -> Host:
    return Host(tmp_path / name / "state", Path("/dev/shm") / f"sg-{uuid.uuid4().hex[:8]}", criu)


def assignment(tmp_path: Path, image_url: str, store: str, sink: EventSink) -> Path:
    path = tmp_path / f"assignment-{uuid.uuid4().hex[:6]}.json"
    path.write_text(
        Assignment(
            job="train", image_url=image_url, store=store, controller_url=sink.url
        ).user_data()
    )
    return path


@pytest.mark.parametrize("stream", ["on", "off"], ids=["streamed", "staged"])
async def test_a_damaged_chunk_is_refused_before_any_file_of_the_job_is_written(
    host: Host,
    sink: EventSink,
    tmp_path: Path,
    stream: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    good = tmp_path / "store"
    image_url, job = await exit_image(host, f"file://{good}", stream)
    m = await manifest_of(image_url)
    assert ("stream" in m.meta) == (stream == "on")
    victim, other = _pages_chunks(m)
    shutil.rmtree(job.dir)  # the new VM has nothing of the job yet
    caplog.set_level(logging.DEBUG)
    for name, damage in DAMAGES.items():
        bad = tmp_path / f"store-{name}"
        shutil.copytree(good, bad)
        damage(bad, "train", victim, other)
        url = image_url.replace(f"file://{good}", f"file://{bad}")
        vm = new_vm(tmp_path, f"vm-{name}", host.criu)
        caplog.clear()
        sink.events.clear()
        try:
            async with running_agent(
                vm, sink, cloud="none", store=f"file://{bad}",
                assignment=assignment(tmp_path, url, f"file://{bad}", sink),
            ) as agent:  # fmt: skip
                await wait_until(lambda: "restore_failed" in sink.kinds("train"))
                assert agent.died is None and "train" not in agent.workers
        finally:
            shutil.rmtree(vm.shm, ignore_errors=True)
        failed = next(e for e in sink.events if e["kind"] == "restore_failed")
        err = failed["error"]
        assert (err["code"], err["retryable"], err["image_fault"]) == (
            "image_corrupt",
            False,
            True,
        ), (name, err)
        assert victim in err["message"] or other in err["message"], (name, err)  # named
        # Nothing of the job was written, and the engine (files, CRIU) never started.
        assert not job.dir.exists(), name
        assert not StateDir(vm.state).job("train").exists(), name
        assert not any(r.name.startswith("spotguard.checkpoint") for r in caplog.records), name
        assert not any(r.exc_info for r in caplog.records), name
        staged = [
            p for p in (vm.shm, StateDir(vm.state).staging) if p.is_dir() and any(p.iterdir())
        ]
        assert staged == [], name  # a partial pull is removed
    # The undamaged image still restores: the test damaged only its copies.
    vm = new_vm(tmp_path, "vm-good", host.criu)
    restored = await operations.restore(
        image_url, settings=vm.checkpoint_settings(), image_settings=ImageSettings()
    )
    try:
        assert (job.dir / "stdout").exists()
    finally:
        os.kill(restored.pid, signal.SIGKILL)
        shutil.rmtree(vm.shm, ignore_errors=True)


def page_rounded(m: Manifest) -> int:
    """Bytes a pull of ``m`` takes on a tmpfs (every file occupies whole pages)."""
    return sum(-(-f.size // PAGE) * PAGE for f in m.files)


async def test_disk_full_while_staging_a_restore_is_reported_and_the_agent_runs_on(
    host: Host, sink: EventSink, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = f"file://{tmp_path}/store"
    image_url, job = await exit_image(host, store, "off")
    m = await manifest_of(image_url)
    shutil.rmtree(job.dir)
    # A staging place that holds the image's bytes (the plan checks that) but not the pages
    # its many small files take: the disk fills up in the middle of the pull.
    size = -(-m.totals.bytes // PAGE) * PAGE + 2 * PAGE
    assert size < page_rounded(m)
    caplog.set_level(logging.INFO)
    with tmpfs(tmp_path / "small", size) as small:
        vm = Host(tmp_path / "vm" / "state", small, host.criu)
        async with running_agent(
            vm, sink, cloud="none", store=store, checkpoint={"memory_margin": 0},
            assignment=assignment(tmp_path, image_url, store, sink),
        ) as agent:  # fmt: skip
            await wait_until(lambda: "restore_failed" in sink.kinds("train"))
            await wait_until(lambda: agent.reporter.sent >= 2)
            assert agent.died is None and agent.api is not None
            assert agent.status()["agent"]["pid"] == os.getpid()  # it runs on
        assert list(small.iterdir()) == []  # the partial pull is gone
    failed = next(e for e in sink.events if e["kind"] == "restore_failed")
    assert "No space left on device" in failed["error"]["message"], failed["error"]
    assert failed["error"]["code"] != "internal" and failed["error"]["image_fault"] is False
    assert not job.dir.exists()
    assert not any(r.exc_info for r in caplog.records)


async def test_a_full_state_dir_at_boot_still_reports_restore_failed(
    host: Host, sink: EventSink, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = f"file://{tmp_path}/store"
    image_url, job = await exit_image(host, store, "off")
    shutil.rmtree(job.dir)
    caplog.set_level(logging.INFO)
    with tmpfs(tmp_path / "vm", 256 << 10) as disk:
        vm = Host(disk / "state", disk / "shm", host.criu)
        # An agent ran here before (its lock, API token and outbox exist); then the disk filled.
        async with running_agent(vm, None, cloud="none", store=store) as first:
            await wait_until(lambda: first.api is not None)
        fill(disk)
        async with running_agent(
            vm, sink, cloud="none", store=store,
            assignment=assignment(tmp_path, image_url, store, sink),
        ) as agent:  # fmt: skip
            await wait_until(lambda: "restore_failed" in sink.kinds("train"))
            assert agent.died is None and agent.api is not None
            assert agent.status()["agent"]["pid"] == os.getpid()  # it runs on
        assert "restoring" in sink.kinds("train")
    said = [r.getMessage() for r in caplog.records]
    assert "report could not be spooled; sending it from memory" in said  # the disk was full
    assert "cannot record the assignment's progress" in said
    failed = next(e for e in sink.events if e["kind"] == "restore_failed")
    assert "no room to stage the image" in failed["error"]["message"], failed["error"]
    assert not job.dir.exists()
    assert not any(r.exc_info for r in caplog.records)
