"""Full local space (issue 31, item 7; item 14's unwritable state dir), with real CRIU, a real
job, real tmpfs mounts and a real ``file://`` store:

* the in-memory staging (a small tmpfs of the test's own) filled by another process during a
  staged dump: the freeze failed with most of the notice left and nothing retried; now the
  dump is done again staged on disk within the deadline, and the image is durable;
* a state dir that cannot be written — full of the job's own output, or read-only: the
  checkpoint aborted at the crash marker's write (``OSError: [Errno 28]`` / ``[Errno 30]``)
  before any image; now the marker goes to ``/run/spotguard/markers`` (or the freeze goes
  on with a logged error), a best-effort record never aborts it, and the image is durable.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from spotguard import operations
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, list_jobs, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.contracts import Mode
from spotguard.image import ImageSettings, list_images

pytestmark = [pytest.mark.criu, pytest.mark.timeout(180)]

#: a step every 0.1 s: once the state dir is full the job's output lines fill the last page
#: of its stdout file (~70 lines) and then its write fails and it ends; at 0.02 s a step that
#: left 1.4 s, which a loaded CI machine once spent before the freeze (the job was gone)
LONG = [
    *(sys.executable, "-m", "spotguard.demo.job", "--gpu", "no", "--mb", "24"),
    *("--steps", "100000", "--step-seconds", "0.1"),
]
IMG = ImageSettings(chunk_size=1 << 20, workers=1, max_inflight_mb=8)

Mount = Callable[[str, str], Path]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Mount]:
    """``tmpfs(name, options)``: a real tmpfs under tmp_path (unmounted after)."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        mnt = tmp_path / name
        mnt.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)]).returncode:
            pytest.skip("needs root to mount a tmpfs")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in reversed(mounted):
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _kill_jobs(state: Path) -> None:
    for k in list_jobs(state):
        if proctree.alive(k.pid):
            proctree.signal_all(proctree.tree(k.pid), signal.SIGKILL)


def _room_to_grow(path: Path, nbytes: int) -> None:
    """Pages for ``path`` to grow by ``nbytes`` that a full filesystem cannot take away
    (``fallocate`` with ``FALLOC_FL_KEEP_SIZE``: its size unchanged). The job prints a line
    every step into its output in the state dir: once that fills, its next line past the last
    page it has fails with ENOSPC and the job dies — sometimes in the middle of the dump."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    fd = os.open(path, os.O_WRONLY)
    try:
        if libc.fallocate(fd, 1, os.fstat(fd).st_size, nbytes) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fallocate {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _fill(where: Path) -> None:
    """Write into ``where`` until the filesystem is full (ENOSPC)."""
    block = b"\0" * (1 << 20)
    try:  # unbuffered: the close has nothing left to flush into the full filesystem
        with open(where, "wb", buffering=0) as f:
            while True:
                f.write(block)
    except OSError:
        pass


def _fill_when_staging_starts(shm: Path, stop: threading.Event) -> threading.Thread:
    """Another process's files fill the tmpfs the moment a staged dump starts there."""

    def run() -> None:
        while not stop.is_set():
            if any(p.is_dir() for p in shm.iterdir()):
                _fill(shm / "other-process-data")
                return
            stop.wait(0.001)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("mode", ["resume", "exit"])
async def test_a_full_tmpfs_during_a_staged_dump_falls_back_to_disk_staging(
    tmpfs: Mount, tmp_path: Path, criu_bin: str, mode: str
) -> None:
    shm = tmpfs("shm", "size=96m")
    settings = CheckpointSettings(
        state_dir=tmp_path / "state", shm_dir=shm, criu=criu_bin, criu_timeout=60,
        memory_margin=0,
    )  # fmt: skip
    job = await start_job(LONG, "filler", state_dir=settings.state_dir)
    stop = threading.Event()
    try:
        await asyncio.sleep(1.0)  # its memory is written
        filler = _fill_when_staging_starts(shm, stop)
        deadline = datetime.now(UTC) + timedelta(seconds=90)
        t0 = asyncio.get_running_loop().time()
        result = await operations.checkpoint(
            job, f"file://{tmp_path}/store", mode=Mode(mode), settings=settings, image_settings=IMG,
            stream="off", deadline=deadline,
        )  # fmt: skip
        took = asyncio.get_running_loop().time() - t0
        filler.join(5)
        assert (shm / "other-process-data").exists(), "the tmpfs was never filled"
        assert result.image_url and took < 90
        assert [
            i.url for i in await list_images(f"file://{tmp_path}/store", "filler", settings=IMG)
        ] == [result.image_url]
        assert proctree.alive(job.pid) == (mode == "resume")
        assert not any(settings.disk_staging_dir.iterdir()), "the disk copy is left behind"
    finally:
        stop.set()
        _kill_jobs(settings.state_dir)


def _fallback_markers_of(job_dir: Path) -> list[Path]:
    """Markers left in /run/spotguard/markers for the job in ``job_dir``."""
    found = []
    for p in Path("/run/spotguard/markers").glob("*.json"):
        try:
            if json.loads(p.read_text()).get("dir") == str(job_dir):
                found.append(p)
        except (OSError, ValueError):
            continue
    return found


def _read_only(path: Path) -> None:
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)


@pytest.mark.parametrize("stream", ["auto", "off"])
@pytest.mark.parametrize("how", ["full", "read-only"])
async def test_a_state_dir_that_cannot_be_written_never_aborts_the_checkpoint(
    tmpfs: Mount, tmp_path: Path, criu_bin: str, how: str, stream: str
) -> None:
    state = tmpfs("state", "size=16m")
    settings = CheckpointSettings(
        state_dir=state, shm_dir=tmp_path / "shm", criu=criu_bin, criu_timeout=60
    )
    store = f"file://{tmp_path}/store"
    job: JobInfo = await start_job(LONG, "train", state_dir=state)
    try:
        # the agent ran before: a periodic image, the host's key and records exist
        await operations.checkpoint(
            job, store, mode=Mode.RESUME, settings=settings, image_settings=IMG, stream=stream
        )
        if how == "full":
            _room_to_grow(job.dir / "stdout", 1 << 20)  # its own lines still fit (see there)
            _fill(job.dir / "big-output")  # the job's own output fills the state dir
        else:
            _read_only(state)
        with pytest.raises(OSError):
            (job.dir / "probe").write_text("x")
        result = await operations.checkpoint(
            job, store, mode=Mode.EXIT, settings=settings, image_settings=IMG, stream=stream
        )
        assert result.image_url and not proctree.alive(job.pid)
        assert len(await list_images(store, "train", settings=IMG)) == 2
        assert not _fallback_markers_of(job.dir), "the fallback marker was left behind"
    finally:
        _kill_jobs(state)
        if how == "read-only":
            await asyncio.to_thread(subprocess.run, ["umount", "-l", str(state)], check=False)
        for p in _fallback_markers_of(job.dir):
            p.unlink()
