"""A dump whose owner (the agent) is killed part-way must leave the job exactly as it was.

CRIU seizes the job's processes and runs its parasite inside each one. If CRIU itself dies
then — it used to die with the process that started it — the kernel lets the processes go
wherever they are: in the parasite's code (its mapping stays in the job for ever) or, in the
instants CRIU is setting the parasite up, at a breakpoint with nobody tracing them (the job
dies of SIGTRAP). So CRIU must outlive its owner and unwind the job itself: a dump whose
stream has lost its reader fails there and CRIU cures every task; a dump that has written its
image asks its owner in the post-dump hook, and an owner that is gone is a "no" (the job is
resumed, not killed). Real CRIU, a real job, the owner a real process killed with SIGKILL.

A restarted agent must not bring the job back while such a CRIU still holds it:
:func:`spotguard.checkpoint.recovery.recover` waits for the CRIU to let the job go (and stops
one that holds it longer than a dump may take).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import psutil
import pytest
from ckpt_helpers import DEMO, mount_args, progresses, wait_for

from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.checkpoint.marker import MARKER
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.errors import StepTimeout
from spotguard.stream.capture import Capture

pytestmark = pytest.mark.criu

OWNER = Path(__file__).parent / "progs" / "dump_owner.py"
#: enough memory that the stalled capture's pipe fills while the first task is written
JOB = [*DEMO[:-2], "--mb", "64", "--steps", "100000", "--step-seconds", "0.05"]


def _criu_mapped(pids: list[int]) -> list[str]:
    """Mappings of CRIU's parasite (its memfd) left in ``pids``."""
    left = []
    for pid in pids:
        with open(f"/proc/{pid}/maps") as maps:
            left += [f"{pid}: {ln.strip()}" for ln in maps if "CRIUMFD" in ln]
    return left


def _criu_running(images: Path) -> list[int]:
    """CRIU processes still working on ``images``."""
    out = subprocess.run(["pgrep", "-f", f"dump -t .* -D {images}"], capture_output=True)
    return [int(p) for p in out.stdout.split()]


async def _owner_killed_at(where: str, criu_bin: str, tmp_path: Path) -> tuple[JobInfo, Path]:
    """Start a job, a dump of it by a separate owner process, and kill the owner (its whole
    process group, as systemd or the OOM killer would) once the dump stalls at ``where``."""
    job = await start_job(JOB, "owned", state_dir=tmp_path / "state")
    await progresses(job.dir / "stdout", 30)
    images = tmp_path / "img"
    images.mkdir()
    with (tmp_path / "owner.err").open("wb") as err:
        owner = await asyncio.create_subprocess_exec(
            sys.executable, str(OWNER), str(job.pid), str(images), where, criu_bin,
            start_new_session=True, stdout=asyncio.subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    try:
        await wait_for(lambda: (images / "stalled").exists(), f"the dump to stall ({where})", 60)
        assert proctree.tracers(proctree.tree(job.pid)), "CRIU does not hold the job"
    finally:
        os.killpg(owner.pid, signal.SIGKILL)
        await owner.wait()
    return job, images


async def _job_let_go(job: JobInfo, images: Path) -> None:
    tree = proctree.tree(job.pid)
    await wait_for(lambda: not proctree.tracers(tree), "CRIU to let the job go", 60)
    await wait_for(lambda: not _criu_running(images), "the owner-less CRIU to end", 60)
    assert proctree.alive(job.pid), "the job was killed"
    await progresses(job.dir / "stdout", 30)


def _kill_job(job: JobInfo) -> None:
    proctree.signal_all(proctree.tree(job.pid), signal.SIGKILL)


async def test_an_owner_killed_while_criu_writes_pages_leaves_the_job_clean(
    criu_bin: str, tmp_path: Path
) -> None:
    """The owner dies with CRIU's parasite inside the job: CRIU's stream fails, and CRIU
    itself cures the job — it runs on with nothing of CRIU left in it, and dumps again."""
    job, images = await _owner_killed_at("pages", criu_bin, tmp_path)
    try:
        await _job_let_go(job, images)
        assert not _criu_mapped(proctree.tree(job.pid)), "CRIU's parasite is left in the job"
        log = (images / "criu-dump.log").read_text(errors="replace")
        assert "Dumping FAILED" in log, "CRIU did not unwind the dump itself"
        again = tmp_path / "again"
        again.mkdir()
        await Criu(criu_bin).dump(job.pid, again, leave_running=True, **mount_args(job.pid))
        await progresses(job.dir / "stdout", 30)
    finally:
        _kill_job(job)


async def test_an_owner_killed_while_criu_waits_in_the_post_dump_hook_resumes_the_job(
    criu_bin: str, tmp_path: Path
) -> None:
    """The image is written and CRIU asks its owner whether to kill the job (exit mode):
    the owner is gone, so the answer is no and the job runs on — CRIU neither waits for an
    answer for ever (the job frozen) nor kills a job whose image nobody keeps."""
    job, images = await _owner_killed_at("hook", criu_bin, tmp_path)
    try:
        await _job_let_go(job, images)
        assert not _criu_mapped(proctree.tree(job.pid))
    finally:
        _kill_job(job)


def _owner_prog() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dump_owner", OWNER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def _give_up(criu: Criu, job: JobInfo, images: Path, limit: float | None) -> None:
    """A streamed dump whose capture stalls on the pages: past ``limit`` seconds, or (None)
    cancelled once CRIU holds the job; leaving the capture aborts its stream."""
    owner = _owner_prog()
    async with Capture(images, owner._StallPages(images), **owner.SMALL):
        dump = asyncio.ensure_future(
            criu.dump(
                job.pid,
                images,
                leave_running=False,
                stream=True,
                time_limit=limit,
                **mount_args(job.pid),
            )
        )
        if limit is None:
            await wait_for(lambda: (images / "stalled").exists(), "the dump to stall", 60)
            assert proctree.tracers(proctree.tree(job.pid)), "CRIU does not hold the job"
            dump.cancel()
        await dump


@pytest.mark.parametrize("how", ["cancelled", "past-its-time"])
async def test_a_dump_given_up_with_criu_in_the_job_leaves_the_job_clean(
    criu_bin: str, tmp_path: Path, how: str
) -> None:
    """A dump given up by its caller (cancelled, or past its time limit) while CRIU's
    parasite is inside the job: CRIU is not killed there but left to unwind the dump — its
    stream is aborted as the caller leaves — so the job runs on with nothing of CRIU in it."""
    job = await start_job(JOB, "given-up", state_dir=tmp_path / "state")
    await progresses(job.dir / "stdout", 30)
    images = tmp_path / "img"
    images.mkdir()
    limit = 3.0 if how == "past-its-time" else None
    try:
        with pytest.raises(asyncio.CancelledError if limit is None else StepTimeout):
            await _give_up(Criu(criu_bin, page_workers=0), job, images, limit)
        await _job_let_go(job, images)
        assert not _criu_mapped(proctree.tree(job.pid)), "CRIU's parasite is left in the job"
        assert "Dumping FAILED" in (images / "criu-dump.log").read_text(errors="replace")
    finally:
        _kill_job(job)


# --- recovery waits for a CRIU still holding the job --------------------------------------

_HOLDER = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
# argv: /usr/sbin/criu dump -t PID HOLD READY — it stands for a killed agent's CRIU
pid, hold, ready = int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
    if libc.ptrace(0x4206, tid, 0, 0) != 0 or libc.ptrace(0x4207, tid, 0, 0) != 0:
        sys.exit(f"ptrace {tid}: errno {ctypes.get_errno()}")
    os.waitpid(tid, 0x40000000)  # __WALL: the stop
open(ready, "w").close()
time.sleep(hold)  # then exits: the kernel lets the job go
"""


@pytest.fixture
def stopped_job(tmp_path: Path) -> Iterator[tuple[JobInfo, Path]]:
    """A running process (a job's root) and the file it appends to."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        ["/bin/sh", "-c", f"while :; do echo x >> {out}; sleep 0.05; done"],
        start_new_session=True,
    )
    job = JobInfo(name="held", pid=proc.pid, dir=tmp_path / "state" / "jobs" / "held")
    job.dir.mkdir(parents=True)
    yield job, out
    proc.kill()
    proc.wait()


def _marker_of_a_killed_agent(job: JobInfo) -> None:
    dead = subprocess.Popen(["/bin/sleep", "0.1"])
    dead.wait()
    (job.dir / MARKER).write_text(
        json.dumps({
            "op": "freeze", "mode": "exit", "agent_pid": dead.pid, "agent_start": 1,
            "job_pid": job.pid, "started": "2026-11-28T00:00:00+00:00", "gpu_pids": [],
            "tree": [job.pid],
        })
    )  # fmt: skip


def _hold(
    job: JobInfo, seconds: float, tmp_path: Path, script: str = _HOLDER
) -> subprocess.Popen[bytes]:
    ready = tmp_path / "held"
    argv = ["/usr/sbin/criu", "dump", "-t", str(job.pid), str(seconds), str(ready)]
    holder = subprocess.Popen([sys.executable, "-c", script, *argv])
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert holder.poll() is None, "the holder could not trace the job"
        assert time.monotonic() < deadline, "the holder never held the job"
        time.sleep(0.02)
    return holder


@pytest.mark.parametrize("hold", [2.0, 3600.0], ids=["lets-go", "never-lets-go"])
async def test_recovery_waits_for_a_criu_still_holding_the_job(
    stopped_job: tuple[JobInfo, Path], criu_bin: str, tmp_path: Path, hold: float
) -> None:
    """A killed agent's CRIU may still be unwinding the job when the new agent recovers it:
    recovery brings the job back only once CRIU has let it go, and stops a CRIU that holds it
    longer than a dump may take (``criu_timeout``) rather than leave the job frozen."""
    job, out = stopped_job
    _marker_of_a_killed_agent(job)
    holder = _hold(job, hold, tmp_path)
    settings = CheckpointSettings(
        state_dir=tmp_path / "state", shm_dir=tmp_path / "shm", criu=criu_bin, criu_timeout=4
    )
    try:
        assert await Engine(Criu(criu_bin), settings=settings).recover(job)
        assert not proctree.tracers([job.pid]), "recovery returned while CRIU still held the job"
        # it let go by itself, or recovery killed it once it held the job past criu_timeout
        assert holder.wait(10) == (0 if hold < 4 else -signal.SIGKILL)
        assert not (job.dir / MARKER).exists()
        await progresses(out, 10)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


# A holder that, its hold over, reads as a process in the last instants of its exit: no
# command line (an exiting process's memory goes before its tracees are let go), still
# tracing the job for a while. A loaded machine showed that window as a flake of the test
# above; here its own argument bytes are zeroed to hold it open for a second and a half.
_BLANKING_HOLDER = _HOLDER.replace(
    "time.sleep(hold)  # then exits: the kernel lets the job go",
    """time.sleep(hold)
stat = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
arg_start, arg_end = int(stat[45]), int(stat[46])  # fields 48 and 49
ctypes.memset(arg_start, 0, arg_end - arg_start)
open(ready + ".blank", "w").close()
time.sleep(1.5)  # then exits: the kernel lets the job go""",
)


async def test_recovery_waits_for_a_criu_whose_command_line_is_gone(
    stopped_job: tuple[JobInfo, Path], criu_bin: str, tmp_path: Path
) -> None:
    """A CRIU in the last instants of its exit has no command line left yet still traces the
    job: recovery must not take it for a stranger and bring the job back under it."""
    job, out = stopped_job
    _marker_of_a_killed_agent(job)
    holder = _hold(job, 0, tmp_path, _BLANKING_HOLDER)
    try:
        await wait_for(lambda: (tmp_path / "held.blank").exists(), "the holder's blank", 30)
        assert not "".join(psutil.Process(holder.pid).cmdline())
        assert proctree.tracers([job.pid]), "the blanked holder no longer traces the job"
        settings = CheckpointSettings(
            state_dir=tmp_path / "state", shm_dir=tmp_path / "shm", criu=criu_bin,
            criu_timeout=30,
        )  # fmt: skip
        assert await Engine(Criu(criu_bin), settings=settings).recover(job)
        assert not proctree.tracers([job.pid]), "recovery returned while CRIU still held the job"
        assert holder.wait(10) == 0
        await progresses(out, 10)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
