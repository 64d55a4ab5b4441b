"""PID and mount namespaces of jobs, with real CRIU.

* A job started by ``start_job`` (GPU jobs included) has its own PID namespace AND its own
  /proc — what CUDA needs to initialise there — and is parked and unparked back to back.
* A ``--no-pid-namespace`` job restored right after it was killed, while zombies of the
  killed job still hold its PIDs: restore waits for them instead of failing (also when the
  image streams from a store, where CRIU cannot simply be run again).
* A live process holding a needed PID is named at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from ckpt_helpers import lines, wait_exit, wait_for

from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import own_mount_ns, start_job
from spotguard.checkpoint.preflight import pid_holder, wait_pids_free
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.errors import PreflightError
from spotguard.image import ImageSettings
from spotguard.image.catalog import latest_image
from spotguard.stream import StreamSource, StreamTarget

pytestmark = [
    pytest.mark.criu,
    pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning"),
]

PR_SET_CHILD_SUBREAPER = 36

#: prints what the job sees of its namespace, then counts slowly
COUNTER = """
import os, sys, time
me = os.readlink("/proc/self")
procs = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print("self", me, os.getpid(), "visible", len(procs), flush=True)
for i in range(int(sys.argv[1])):
    print(i, flush=True)
    time.sleep(0.05)
"""
STEPS = 80


def _expected() -> list[str]:
    return [str(i) for i in range(STEPS)]


@pytest.fixture
def counter(tmp_path: Path) -> list[str]:
    script = tmp_path / "counter.py"
    script.write_text(COUNTER)
    return [sys.executable, str(script), str(STEPS)]


async def test_job_has_own_proc_and_is_parked_and_unparked(
    engine: Engine, settings: CheckpointSettings, counter: list[str], tmp_path: Path
) -> None:
    job = await start_job(counter, "own-proc", state_dir=settings.state_dir)
    out = job.dir / "stdout"
    try:
        await wait_for(lambda: len(lines(out)) > 5, "the job to count")
        head = lines(out)[0].split()
        # its /proc is its namespace's: /proc/self names the pid it knows itself by, and
        # it sees only its own processes (the host's /proc made CUDA fail with error 304)
        assert head[1] == head[2] and int(head[4]) <= 3, head
        assert own_mount_ns(job.pid)
        frozen = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        assert frozen.meta.mount_ns and frozen.meta.root_ns_pid == 1
        await wait_for(lambda: not proctree.alive(job.pid), "the job to stop")
        restored = await engine.restore(DirectorySource(frozen.images_dir))
        assert own_mount_ns(restored.pid)
        assert await wait_exit(restored.job) == 0
        assert lines(out)[1:] == _expected()
    finally:
        for p in (job.pid, *([restored.pid] if "restored" in locals() else [])):
            proctree.signal_all([p], signal.SIGKILL)


@contextlib.contextmanager
def _subreaper() -> Iterator[None]:
    """Orphans of this test (the killed job's processes) become OUR children: they stay
    zombies, holding their PIDs, until we reap them."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def _reap(pids: list[int]) -> None:
    for p in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(p, 0)


@pytest.mark.parametrize("where", ["dir", "store"])
async def test_no_pid_namespace_restore_waits_for_zombies_of_the_killed_job(
    where: str, criu_bin: str, counter: list[str], tmp_path: Path
) -> None:
    settings = CheckpointSettings(
        state_dir=tmp_path / "state", criu=criu_bin, criu_timeout=60, pid_wait=30
    )
    engine = Engine(Criu(criu_bin), settings=settings)
    with _subreaper():
        job = await start_job(
            counter, f"host-pids-{where}", state_dir=settings.state_dir, pid_namespace=False
        )
        out = job.dir / "stdout"
        await wait_for(lambda: len(lines(out)) > 5, "the job to count")
        tree = proctree.tree(job.pid)
        assert not own_mount_ns(job.pid)
        if where == "dir":
            target = DirectoryTarget(tmp_path / "img")
        else:
            target = StreamTarget(
                f"file://{tmp_path / 'store'}", work_root=tmp_path / "w", settings=ImageSettings()
            )
        frozen = await engine.freeze(job, target, Mode.EXIT)
        await wait_for(
            lambda: all(psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in tree),
            "the killed job to become zombies",
        )
        holders = [pid_holder(p) for p in tree]
        assert all(h is not None and h.leaving for h in holders), holders
        if where == "dir":
            source: DirectorySource | StreamSource = DirectorySource(frozen.images_dir)
        else:
            url = await latest_image(
                f"file://{tmp_path / 'store'}", job.name, settings=ImageSettings()
            )
            assert url is not None
            source = StreamSource(url, work_root=tmp_path / "w2", settings=ImageSettings())
        restoring = asyncio.create_task(engine.restore(source))
        await asyncio.sleep(1.5)
        assert not restoring.done(), "restore went ahead while the PIDs were held"
        _reap(tree)  # the zombies go: their PIDs are free
        restored = await restoring
    try:
        assert restored.pid == job.pid  # the same host PIDs
        pre = next(st for st in restored.timeline.steps if st.name == "preflight")
        assert pre.detail["pid_wait_s"] >= 1.0
        assert await wait_exit(restored.job) == 0
        assert lines(out)[1:] == _expected()
    finally:
        proctree.signal_all([restored.pid], signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            psutil.Process(restored.pid).wait(5)


async def test_a_live_process_holding_a_needed_pid_is_named_at_once() -> None:
    me = os.getpid()
    with pytest.raises(PreflightError, match=rf"held here by {me} \("):
        await wait_pids_free([me], limit=60, grace=0.3)


async def test_free_pids_need_no_wait() -> None:
    free = next(p for p in range(4_000_000, 3_000_000, -1) if not psutil.pid_exists(p))
    assert await wait_pids_free([free], limit=5) < 0.5
