"""Helpers shared by the freeze engine's tests (polling, reading job output)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypedDict

import psutil

from sgtest import until
from spotguard.checkpoint import mounts, proctree
from spotguard.checkpoint.jobs import JobInfo, exit_status, own_mount_ns
from spotguard.timeline import Step, Timeline

Launch = Callable[..., Awaitable[JobInfo]]

DEMO = [sys.executable, "-m", "spotguard.demo.job", "--gpu", "no", "--mb", "4"]


#: poll a condition until true, failing the test naming it (``sgtest.until``)
wait_for = until


async def wait_exit(job: JobInfo, limit: float = 60.0) -> int:
    """Wait until the job's command has ended and its init with it (the init writes the exit
    status a moment before it ends: a restore of the job before then is rightly refused as
    running); the command's exit code."""
    await wait_for(lambda: exit_status(job) is not None, f"job {job.name} to finish", limit)
    await wait_for(lambda: not proctree.alive(job.pid), f"job {job.name}'s init to end", limit)
    code = exit_status(job)
    assert code is not None
    return code


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def proc_state(pid: int) -> str:
    """The one-letter state of a process (R, S, T, t, Z ...)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split()[1]
    return "?"


async def progresses(path: Path, limit: float = 10.0) -> None:
    """Fail unless the file gains lines (the job is running, not frozen)."""
    before = len(lines(path))
    await wait_for(lambda: len(lines(path)) > before, f"{path} to grow", limit)


def step_named(tl: Timeline, name: str) -> Step:
    """The one step ``name`` of a timeline."""
    [st] = [st for st in tl.steps if st.name == name]
    return st


def kill_tree(pid: int | None) -> None:
    """SIGKILL ``pid`` and its descendants, whatever is left of them."""
    if pid is None:
        return
    with contextlib.suppress(psutil.Error):
        for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                p.kill()


def mount_args(pid: int) -> MountArgs:
    """What the engine gives ``Criu.dump`` for the mounts of ``pid``'s tree: a job started by
    :func:`start_job` has a mount namespace of its own, a copy of the host's, and a dump that
    does not name the host's mounts as external tars every tmpfs in it — ``/dev/shm``
    included, which the tests running beside it change ("file changed as we read it")."""
    if not own_mount_ns(pid):
        return {"mount_ns": False, "external_mounts": ()}
    return {"mount_ns": True, "external_mounts": mounts.survey(pid).dump_args()}


class MountArgs(TypedDict):
    mount_ns: bool
    external_mounts: Sequence[str]
