"""PID reuse (issue 31, item 5): after the job's death, an unrelated process given its old pid
(forced with ``/proc/sys/kernel/ns_last_pid``) was adopted by the agent, checkpointed under
the job's name and killed by the exit checkpoint of the next drain. The agent now identifies
a job by pid *and* start time (``/proc/PID/stat`` field 22), recorded when it protects the
job (in the worker and its ledger); the liveness check, a checkpoint's start and a restarted
agent's adoption compare identity. Real agent, real CRIU, a real ``spotguard run`` job, a
real ``file://`` store, a real stranger process.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
from agent_helpers import EventSink, Host, job_argv, running_agent, wait_until

from spotguard.agent.ledger import Ledger
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.checkpoint.procfacts import start_time

pytestmark = [pytest.mark.criu, pytest.mark.timeout(180)]

PR_SET_CHILD_SUBREAPER = 36
LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
LONG_JOB = job_argv("--steps", "4000", "--step-seconds", "0.05", "--mb", "4", "--gpu", "no")


def _stranger_with_pid(pid: int) -> subprocess.Popen[bytes]:
    """An unrelated process given ``pid`` (ns_last_pid set just before the fork; retried
    while another process of the host takes it first)."""
    for _ in range(200):
        LAST_PID.write_text(str(pid - 1))
        proc = subprocess.Popen(["/bin/sleep", "120"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    pytest.fail(f"could not get pid {pid} again")


async def _start_job_as_our_child(state: Path) -> JobInfo:
    """The long job, its init made a child of this process (a child subreaper while
    ``spotguard run``'s launcher exits), so that the test reaps it the instant it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        job = await start_job(LONG_JOB, "train", state_dir=state)
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    assert psutil.Process(job.pid).ppid() == os.getpid()
    return job


def _kill_and_reuse(job: JobInfo) -> subprocess.Popen[bytes]:
    """Kill the job's tree, reap it, give its pid to a stranger: a few ms, far less than
    the agent's liveness period."""
    os.kill(job.pid, signal.SIGKILL)
    os.waitpid(job.pid, 0)
    return _stranger_with_pid(job.pid)


@pytest.fixture(autouse=True)
def _needs_ns_last_pid() -> None:
    if not os.access(LAST_PID, os.W_OK):
        pytest.skip("ns_last_pid is not writable here")


async def test_a_stranger_given_the_dead_jobs_pid_is_not_adopted_by_a_restarted_agent(
    host: Host, sink: EventSink, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    job = await _start_job_as_our_child(host.state)
    stranger = None
    try:
        async with running_agent(host, sink, cloud="none", job=["train"], store=store):
            await wait_until(lambda: "started" in sink.kinds("train"), 30)
        rec = Ledger(host.state / "agent" / "jobs").get("train")
        started = start_time(job.pid)
        stranger = _kill_and_reuse(job)
        sink.events.clear()
        async with running_agent(
            host, sink, cloud="none", job=["train"], store=store
        ) as agent:  # fmt: skip
            await wait_until(lambda: "train" in agent.workers, 30)
            answer = await agent.drain("pid reuse", wait=True, deadline_s=30)
            assert not any(r.get("url") for r in answer["results"]), answer
            assert agent.workers["train"].state == "finished"
        assert stranger.poll() is None, "the stranger given the job's pid was killed"
        kinds = sink.kinds("train")
        assert "started" not in kinds and "durable" not in kinds, kinds
        assert "job_finished" in kinds, kinds
        assert not list((tmp_path / "store").rglob("manifest*")), "the stranger was checkpointed"
        assert rec is not None and rec.pid == job.pid
        assert getattr(rec, "start", None) == started  # the identity, recorded when protected
    finally:
        if stranger is not None:
            stranger.kill()
            stranger.wait()
        if stranger is None and proctree.alive(job.pid):
            os.kill(job.pid, signal.SIGKILL)
            await asyncio.to_thread(os.waitpid, job.pid, 0)


async def test_a_stranger_given_the_jobs_pid_while_the_agent_runs_is_not_checkpointed(
    host: Host, sink: EventSink, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    job = await _start_job_as_our_child(host.state)
    stranger = None
    try:
        async with running_agent(
            host, sink, cloud="none", job=["train"], store=store
        ) as agent:  # fmt: skip
            await wait_until(lambda: "started" in sink.kinds("train"), 30)
            # dies and its pid is taken again between two liveness looks (1 s apart)
            stranger = _kill_and_reuse(job)
            answer = await agent.drain("pid reuse", wait=True, deadline_s=30)
            assert not any(r.get("url") for r in answer["results"]), answer
            await wait_until(lambda: agent.workers["train"].state == "finished", 10)
        assert stranger.poll() is None, "the stranger given the job's pid was killed"
        kinds = sink.kinds("train")
        assert "durable" not in kinds and "frozen" not in kinds, kinds
        assert not list((tmp_path / "store").rglob("manifest*")), "the stranger was checkpointed"
    finally:
        if stranger is not None:
            stranger.kill()
            stranger.wait()
        if stranger is None and proctree.alive(job.pid):
            os.kill(job.pid, signal.SIGKILL)
            await asyncio.to_thread(os.waitpid, job.pid, 0)


def test_a_stranger_at_the_jobs_pid_is_told_apart_by_the_start_the_job_file_records(
    tmp_path: Path,
) -> None:
    """The job file names the job's start time: a process at its pid with another start is
    a stranger even where the file was written after that process started (a job file saved
    again later, and no ledger record to compare with)."""
    from spotguard.agent import identity

    stranger = subprocess.Popen(["/bin/sleep", "60"])
    try:
        started = start_time(stranger.pid)
        assert started is not None
        d = tmp_path / "jobs" / "train"
        d.mkdir(parents=True)
        job = JobInfo("train", stranger.pid, d, ("python",), str(tmp_path), start=started - 100)
        job.save()  # written now: after the stranger started
        assert identity.of_job(job, None) is None
        same = JobInfo("train", stranger.pid, d, ("python",), str(tmp_path), start=started)
        found = identity.of_job(same, None)
        assert found is not None and found.start == started
    finally:
        stranger.kill()
        stranger.wait()
