"""Checkpoint two jobs while bind mounts exist, take the mounts away, restore both; run by
tests/faults/test_faults_mounts.py as ``unshare -m --propagation private python THIS DIR
CRIU`` so that the bind mounts live only in this private mount namespace (nothing of them
reaches the host, or another test's jobs).

* ``SPARE``: bind mounts the jobs never touch (a directory, one inside it, a file).
* ``data``: a bind mount the ``reader`` job holds a file of open (``DIR/data`` from
  ``DIR/data-src``).

Both jobs count to the end after their exit checkpoint into a real ``file://`` store; then
every mount is unmounted and its mountpoint and source removed, the ``reader`` restored first
(expected refused) and the ``idle`` job second (expected to come back and finish). Prints
one JSON object with what happened; the test asserts on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from spotguard import operations
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, exit_status, list_jobs, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.contracts import Mode
from spotguard.image import ImageSettings
from spotguard.image.catalog import latest_image

STEPS = 150
#: counts to STEPS (one line each 30 ms: 4.5 s, so a loaded host still freezes it
#: mid-count); with a file named, holds it open all along
COUNTER = (
    "import sys, time\n"
    "held = open(sys.argv[2]) if len(sys.argv) > 2 else None\n"
    "for i in range(int(sys.argv[1])):\n"
    "    print(i, flush=True)\n"
    "    time.sleep(0.03)\n"
)


class _Lines(logging.Handler):
    """Every log record's message and extra fields, for the test to look at."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        extra = {k: str(v) for k, v in record.__dict__.items() if k in ("mountpoint", "step")}
        self.records.append({"msg": record.getMessage(), **extra})


def _lines(job: JobInfo) -> list[str]:
    p = job.dir / "stdout"
    return p.read_text().splitlines() if p.exists() else []


async def _wait(cond: Any, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.03)


#: the mounts the jobs never touch (mountpoint, source), parents first: a directory two
#: levels under a directory that goes too, a mount inside it, a file (its name with a space),
#: and one whose mountpoint stays on the host (only its source goes)
SPARE = (
    ("gone/spare", "spare-src"),
    ("gone/spare/inner", "inner-src"),
    ("spare file", "file-src"),
    ("kept", "kept-src"),
)


def _bind(root: Path) -> None:
    """The bind mounts; a file in ``data``."""
    (root / "spare-src" / "inner").mkdir(parents=True)
    (root / "inner-src").mkdir()
    (root / "kept-src").mkdir()
    (root / "kept").mkdir()
    (root / "gone" / "spare").mkdir(parents=True)
    (root / "file-src").write_text("not the job's\n")
    (root / "spare file").touch()
    (root / "data-src").mkdir()
    (root / "data").mkdir()
    for mountpoint, source in (*SPARE, ("data", "data-src")):
        subprocess.run(["mount", "--bind", root / source, root / mountpoint], check=True)
    (root / "data" / "input.txt").write_text("the job's data\n")


def _take_away(root: Path) -> None:
    """Every mount gone, their mountpoints and sources too (a host that never had them)."""
    for mountpoint, _ in reversed((*SPARE, ("data", "data-src"))):
        subprocess.run(["umount", root / mountpoint], check=True)
    for name in ("gone", "spare-src", "inner-src", "kept-src", "data", "data-src"):
        shutil.rmtree(root / name)
    for name in ("spare file", "file-src"):
        (root / name).unlink()


def _mounted_under(pid: int, root: Path) -> list[str]:
    """The mountpoints under ``root`` that process ``pid`` sees."""
    with open(f"/proc/{pid}/mountinfo") as f:
        return [ln.split()[4] for ln in f if ln.split()[4].startswith(str(root))]


async def _restore(
    job: JobInfo, store: str, settings: CheckpointSettings, img: ImageSettings
) -> dict[str, Any]:
    url = await latest_image(store, job.name, settings=img)
    assert url is not None
    before = len(_lines(job))
    try:
        rr = await operations.restore(url, settings=settings, image_settings=img)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {
            "ok": False,
            "error": type(exc).__name__,
            "message": str(exc),
            "lines_after_refusal": len(_lines(job)) - before,
        }
    mounted = _mounted_under(rr.pid, settings.state_dir.parent)
    await _wait(lambda: exit_status(rr.job) is not None, f"{job.name} to finish")
    return {
        "ok": True,
        "pid": rr.pid,
        "exit": exit_status(rr.job),
        "lines": _lines(job),
        "mounted": mounted,
    }


def kill_jobs(state_dir: Path) -> None:
    """Every job of ``state_dir`` still alive, killed (the scenario's end, however it ends)."""
    for job in list_jobs(state_dir):
        if proctree.alive(job.pid):
            proctree.signal_all([job.pid], signal.SIGKILL)


async def main(root: Path, criu: str) -> dict[str, Any]:
    handler = _Lines()
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    _bind(root)
    settings = CheckpointSettings(
        state_dir=root / "state", shm_dir=root / "shm", criu=criu, criu_timeout=60
    )
    img = ImageSettings(chunk_size=1 << 20, workers=1, max_inflight_mb=4)
    store = f"file://{root / 'store'}"
    counter = [sys.executable, "-c", COUNTER, str(STEPS)]
    reader_argv = [*counter, str(root / "data" / "input.txt")]
    out: dict[str, Any] = {}
    jobs: dict[str, JobInfo] = {}
    try:
        # each job started right before its checkpoint: a job that ended first (the reader
        # counting while the idle one was checkpointed on a loaded host) cannot be frozen
        for name, argv in (("idle", counter), ("reader", reader_argv)):
            job = jobs[name] = await start_job(argv, name, state_dir=settings.state_dir, cwd=root)
            await _wait(lambda j=job: len(_lines(j)) > 5, f"{job.name} to count")
            await operations.checkpoint(
                job, store, mode=Mode.EXIT, settings=settings, image_settings=img, stream="off"
            )
            await _wait(lambda j=job: not proctree.alive(j.pid), f"{job.name} to stop")
        _take_away(root)
        out["reader"] = await _restore(jobs["reader"], store, settings, img)
        out["idle"] = await _restore(jobs["idle"], store, settings, img)
        out["left_on_host"] = sorted(os.listdir(root))
        out["log"] = handler.records
    finally:
        kill_jobs(settings.state_dir)
    return out


if __name__ == "__main__":
    os.environ.pop("SPOTGUARD_CONFIG", None)
    result = asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
    print(json.dumps(result))
