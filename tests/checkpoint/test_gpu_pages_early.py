"""The GPU memory the driver staged is copied from the moment CRIU has stopped the processes,
while CRIU still dumps the rest (:func:`spotguard.checkpoint.proctree.wait_seized`), and
never before: a range that a thread of the job keeps writing must come back as it was at the
freeze, in step with the rest of the job's memory.

The job: told "checkpoint" (SIGUSR1, by the stand-in driver) it maps a fresh range — new
writable memory, so the freeze carries it beside CRIU like the driver's staging — and starts a
thread that counts in it and in an ordinary variable, the range first. The range never holds
less than the variable; a copy taken before the freeze would bring back an older count than
CRIU's dump of the variable, and the thread says so ("torn") on its first step after the
restore."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sgtest import StagingGpu, until
from spotguard.checkpoint import inject, proctree
from spotguard.checkpoint.criu import Criu, has_external_pages
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.checkpoint.marker import MARKER
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.errors import CheckpointError

JOB = """
import mmap, os, signal, sys, threading, time
here = sys.argv[1]
count = [0]
if len(sys.argv) > 2:  # a child of its own, as a trainer's workers
    import subprocess
    subprocess.Popen(["sleep", "600"])

def busy(m):
    while True:
        seen = int.from_bytes(m[0:8], "little")
        if seen < count[0]:
            open(os.path.join(here, "torn"), "a").write("%d %d\\n" % (seen, count[0]))
        m[0:8] = (count[0] + 1).to_bytes(8, "little")
        count[0] += 1
        time.sleep(0.0005)

def staged(sig, frame):
    m = mmap.mmap(-1, 96 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    threading.Thread(target=busy, args=(m,), daemon=True).start()
    open(os.path.join(here, "staged"), "w").write("ok")

signal.signal(signal.SIGUSR1, staged)
i = 0
while True:
    print(i, count[0], flush=True)
    i += 1
    time.sleep(0.02)
"""


def _lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


async def _rig(
    criu_bin: str,
    tmp_path: Path,
    name: str,
    faults: MarkerAt | FailAt | None = None,
    *,
    child: bool = False,
    pid_namespace: bool = True,
) -> tuple[JobInfo, Path, Engine]:
    """The busy job started as ``name``, its directory of signals, an engine over both."""
    if not has_external_pages(criu_bin):
        pytest.fail(f"{criu_bin} has no --external-pages: run scripts/install-criu")
    here = tmp_path / "here"
    here.mkdir()
    script = tmp_path / "busy_job.py"
    script.write_text(JOB)
    argv = [sys.executable, str(script), str(here), *(["child"] if child else [])]
    job = await start_job(argv, name, state_dir=tmp_path / "state", pid_namespace=pid_namespace)
    await until(lambda: _lines(job.dir / "stdout") > 3, "the job's first lines")
    settings = CheckpointSettings(
        state_dir=tmp_path / "state", criu=criu_bin, shm_dir=tmp_path / "shm", criu_timeout=60
    )
    return (
        job,
        here,
        Engine(
            Criu(criu_bin),
            StagingGpu(here, "busy_job.py", checks=False),
            settings=settings,
            faults=faults,
        ),
    )


async def test_memory_written_until_the_freeze_is_copied_as_it_was_at_the_freeze(
    criu_bin: str, tmp_path: Path
) -> None:
    job, here, engine = await _rig(criu_bin, tmp_path, "gpupages-early")
    out = job.dir / "stdout"
    restored = None
    try:
        frozen = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        [copy] = [st for st in frozen.timeline.steps if st.name == "gpu_pages"]
        assert copy.detail["while_criu_dumps"] is True  # began before CRIU's post-dump hook
        assert copy.detail["bytes"] >= 96 << 20  # (and the new thread's stack beside it)
        stopped_at = _lines(out)
        restored = await engine.restore(DirectorySource(tmp_path / "img"))
        await until(lambda: _lines(out) > stopped_at + 10, "the restored job counting on")
        assert not (here / "torn").exists(), (here / "torn").read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(restored.pid if restored else job.pid, signal.SIGKILL)


def test_a_process_counts_as_seized_only_once_every_thread_is_stopped_under_a_tracer() -> None:
    """A running process is not seized; ``stop`` ends the wait with False."""
    stop = threading.Event()
    stop.set()
    assert proctree.wait_seized([os.getpid()], stop) is False
    gone = threading.Event()
    timer = threading.Timer(0.2, gone.set)
    timer.start()
    try:
        assert proctree.wait_seized([os.getpid()], gone, interval=0.01) is False
    finally:
        timer.cancel()
    if not inject.supported():
        return
    sleeper = subprocess.Popen(["sleep", "30"])
    maps = Path(f"/proc/{sleeper.pid}/maps")
    try:
        for _ in range(500):  # its C library mapped (just exec'd, the loader may still run)
            if "libc" in maps.read_text():
                break
            time.sleep(0.01)
        with inject.Injector(sleeper.pid):  # seized and stopped, as CRIU's dump does
            assert proctree.wait_seized([sleeper.pid], threading.Event()) is True
    finally:
        sleeper.kill()
        sleeper.wait()


class MarkerAt:
    """A faults seam that reads the restore's crash marker before each step."""

    def __init__(self) -> None:
        self.job_dir: Path | None = None  # the job's, once it started
        self.pending: dict[str, bool] = {}

    async def before(self, step: str) -> None:
        path = self.job_dir / MARKER if self.job_dir else None
        if path is not None and path.exists():
            self.pending[step] = json.loads(path.read_text()).get("pages_pending") is True


async def test_a_park_restore_marks_its_tree_undoable_until_the_staged_memory_is_back(
    criu_bin: str, tmp_path: Path
) -> None:
    """Between CRIU's restore and the staged memory back, the crash marker says so (a
    restore killed there is undone, :mod:`spotguard.checkpoint.recovery`); not after."""
    seen = MarkerAt()
    job, _, engine = await _rig(criu_bin, tmp_path, "gpupages-marked", faults=seen)
    seen.job_dir = job.dir
    restored = None
    try:
        await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        seen.pending.clear()
        restored = await engine.restore(
            DirectorySource(tmp_path / "img"), record=tmp_path / "parked.json"
        )
        assert seen.pending["gpu_pages"] is True
        assert seen.pending["gpu_restore"] is False
        assert seen.pending["finish"] is False
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(restored.pid if restored else job.pid, signal.SIGKILL)


class FailAt:
    """A faults seam that fails one step of a restore."""

    def __init__(self) -> None:
        self.step: str | None = None

    async def before(self, step: str) -> None:
        if step == self.step:
            raise CheckpointError(f"injected failure at {step}")


async def test_a_restore_failing_before_its_memory_is_back_leaves_no_process_of_the_job(
    criu_bin: str, tmp_path: Path
) -> None:
    """A job in the host's PID namespace with a child: a restore that fails after CRIU
    restored the tree (stopped) kills every process of it, not only the root."""
    fail = FailAt()
    job, _, engine = await _rig(
        criu_bin, tmp_path, "gpupages-failed", fail, child=True, pid_namespace=False
    )
    await until(lambda: len(proctree.tree(job.pid)) >= 2, "the job's child")
    pids = proctree.tree(job.pid)  # restored with the same pids (no PID namespace of its own)
    await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
    fail.step = "gpu_pages"
    with pytest.raises(CheckpointError, match="injected failure at gpu_pages"):
        await engine.restore(DirectorySource(tmp_path / "img"))
    await asyncio.sleep(0.3)
    left = [p for p in pids if proctree.alive(p)]
    try:
        assert left == [], f"processes of the failed restore left: {left}"
    finally:
        proctree.signal_all(left, signal.SIGKILL)
