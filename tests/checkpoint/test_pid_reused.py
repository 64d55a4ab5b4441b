"""A job's old pid given to another process (the pid space wraps: 32768 pids on this kind of
VM, a long CI run wraps it) is not the job: a restore used to be refused with "job … is already
running here (pid N)" when N now belonged to a stranger (CI: an unpark after an interrupted
one), and ``spotguard run --name`` refused to start a job whose old pid was reused. A job's
record now keeps its root process's start time, which a stranger with the pid does not share."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.checkpoint.preflight import already_running
from spotguard.checkpoint.procfacts import start_time


@pytest.fixture
def stranger() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _record(state: Path, name: str, pid: int, start: int | None) -> JobInfo:
    job = JobInfo(name=name, pid=pid, dir=state / "jobs" / name, argv=("x",), start=start)
    job.save()
    return job


def test_a_restore_is_not_refused_for_a_stranger_holding_the_jobs_old_pid(
    tmp_path: Path, stranger: int
) -> None:
    state = tmp_path / "state"
    (state / "jobs").mkdir(parents=True, mode=0o700)
    mine = start_time(stranger)
    assert mine is not None
    job = _record(state, "victim", stranger, mine - 1)  # the job's own process started before
    assert already_running(job.to_json(), state) is None
    _record(state, "victim", stranger, mine)  # the process really is the job
    assert already_running(job.to_json(), state) == stranger


async def test_run_starts_a_job_whose_old_pid_a_stranger_holds(
    tmp_path: Path, stranger: int
) -> None:
    state = tmp_path / "state"
    (state / "jobs").mkdir(parents=True, mode=0o700)
    old = start_time(stranger)
    assert old is not None
    _record(state, "again", stranger, old - 1)
    job = await start_job(["sleep", "30"], "again", state_dir=state, pid_namespace=False)
    try:
        assert job.pid != stranger and job.start == start_time(job.pid)
    finally:
        proctree.signal_all(proctree.tree(job.pid), signal.SIGKILL)
