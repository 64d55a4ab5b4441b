"""The agent killed at the worst instants (issue 31, items 3 and 4), with real CRIU, real jobs
and a real ``file://`` store. Each test builds, with the same operations the agent runs, the
exact state such a kill leaves on the host, then starts the agent again:

* killed the instant its exit checkpoint stopped the job, before its own record said so: the
  image is committed in the store, the job is dead with no exit status, the agent's record
  still says ``protecting``. The old agent reported "the job runs on", then ``job_finished``:
  the controller marked the job FINISHED with a complete exit image unused. Now the image is
  reported (``durable`` + ``exited``) so the controller relaunches the job.
* killed between an assignment's restore and its ``restored`` record: the record says
  ``restoring`` (the intent) and the restored job runs. The old agent restored a second
  time — two copies running, both appending to the job's output. Now it finds the restored
  job and reports it ``restored`` once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from agent_helpers import EventSink, Host, job_argv, proc_state, running_agent, wait_until

from spotguard import operations
from spotguard.agent import journal
from spotguard.agent.jobstate import JobState
from spotguard.agent.ledger import Ledger
from spotguard.agent.restore import RestoreProgress, RestoreRecords, RestoreStep
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import resolve_job, start_job
from spotguard.contracts import Assignment, Mode
from spotguard.errors import PreflightError
from spotguard.image import ImageSettings
from spotguard.statedir import StateDir

pytestmark = [pytest.mark.criu, pytest.mark.timeout(180)]

STEPS = "4007"  # a step count no other test uses: finds this job's processes in /proc
LONG_JOB = job_argv("--steps", STEPS, "--step-seconds", "0.05", "--mb", "4", "--gpu", "no")


def _copies() -> list[int]:
    """Pids of every running copy of the sample job with our step count."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = (Path("/proc") / entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"spotguard.demo.job" in argv and STEPS.encode() in argv:
            found.append(int(entry))
    return found


async def _agent_restores_once(
    host: Host, sink: EventSink, store: str, assignment: Path, copies: list[int]
) -> int:
    """An agent started with ``assignment`` reports the job ``restored`` and no copy of it
    appears beside ``copies`` (the pids of those running); the pid it protects."""
    async with running_agent(
        host, sink, cloud="none", store=store, assignment=assignment
    ) as agent:  # fmt: skip
        await wait_until(lambda: "restored" in sink.kinds("train"), 60)
        await asyncio.sleep(2.0)
        assert sorted(_copies()) == copies, "the job was restored a second time"
        return agent.workers["train"].pid


@pytest.mark.parametrize("record", [JobState.PROTECTING, JobState.EXITING])
async def test_agent_killed_when_its_exit_checkpoint_stopped_the_job_reports_the_image(
    host: Host, sink: EventSink, tmp_path: Path, record: JobState
) -> None:
    """``protecting``: killed before the exit checkpoint's intent was written (an older
    agent); ``exiting``: the intent written (journal.checkpointing), its outcome not."""
    store = f"file://{tmp_path}/store"
    job = await start_job(LONG_JOB, "train", state_dir=host.state)
    try:
        async with running_agent(host, sink, cloud="none", job=["train"], store=store):
            await wait_until(lambda: "started" in sink.kinds("train"), 30)
        ledger = Ledger(StateDir(host.state).ledger)
        # What the killed agent's checkpoint did before it could write its record:
        with contextlib.ExitStack() as journaled:
            if record is JobState.EXITING:  # the intent, as the agent writes it; no outcome
                journaled.enter_context(journal.checkpointing(ledger, job, Mode.EXIT, bool))
            result = await operations.checkpoint(
                job, store, mode=Mode.EXIT, settings=host.checkpoint_settings(),
                image_settings=ImageSettings(),
            )  # fmt: skip
        assert not proctree.alive(job.pid)
        before = ledger.get("train")
        assert before is not None and before.state is record
        sink.events.clear()
        async with running_agent(host, sink, cloud="none", job=["train"], store=store) as agent:
            await wait_until(lambda: "exited" in sink.kinds("train"), 30)
            await asyncio.sleep(2.5)  # more than the liveness check's period
            assert agent.workers["train"].state == "exited"
        kinds = sink.kinds("train")
        assert "job_finished" not in kinds and "started" not in kinds, kinds
        durable = next(e for e in sink.events if e["kind"] == "durable")
        exited = next(e for e in sink.events if e["kind"] == "exited")
        assert durable["image_url"] == exited["image_url"] == result.image_url
        assert durable["mode"] == "exit"
    finally:
        if proctree.alive(job.pid):
            os.kill(job.pid, signal.SIGKILL)


async def test_agent_killed_between_a_restore_and_its_record_does_not_restore_twice(
    host: Host, sink: EventSink, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    job = await start_job(LONG_JOB, "train", state_dir=host.state)
    restored = 0
    try:
        image = await operations.checkpoint(
            job, store, mode=Mode.EXIT, settings=host.checkpoint_settings(),
            image_settings=ImageSettings(),
        )  # fmt: skip
        assert not proctree.alive(job.pid)
        a = Assignment(job="train", image_url=image.image_url, store=store, controller_url=sink.url)
        path = tmp_path / "assignment.json"
        path.write_text(a.user_data())
        records = StateDir(host.state).assignments
        # What the killed agent had done: its intent recorded, then the restore itself.
        intent = RestoreProgress.of(a, RestoreStep.RESTORING, started=time.time())
        RestoreRecords(records).save(intent)
        done = await operations.restore(
            a.image_url, settings=host.checkpoint_settings(), image_settings=ImageSettings(),
            job_name="train",
        )  # fmt: skip
        restored = done.pid
        assert _copies() and proctree.alive(restored)
        before = sorted(_copies())
        assert await _agent_restores_once(host, sink, store, path, before) == restored
        [event] = [e for e in sink.events if e["kind"] == "restored"]
        assert event["pid"] == restored
        assert "restoring" not in sink.kinds("train")  # no second attempt began
        assert resolve_job("train", state_dir=host.state).pid == restored
    finally:
        for pid in (job.pid, restored, *_copies()):
            if pid and proctree.alive(pid):
                os.kill(pid, signal.SIGKILL)


#: an agent's restore, run in a child process that dies (SIGKILL, no clean-up) right before
#: the step named by argv[2]: what a killed agent leaves mid-restore
_RESTORE_THEN_DIE = """
import asyncio, json, os, signal, sys
from spotguard import operations
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image import ImageSettings

class Die:
    async def before(self, step):
        if step == sys.argv[2]:
            os.kill(os.getpid(), signal.SIGKILL)

settings = CheckpointSettings(**json.loads(sys.argv[3]))
engine = operations.engine_for(settings)
engine.faults = Die()
asyncio.run(operations.restore(
    sys.argv[1], settings=settings, image_settings=ImageSettings(), engine=engine,
    job_name="train",
))
"""


async def _exit_image(host: Host, store: str, stream: str = "auto") -> str:
    """The test's job started and checkpointed in exit mode into ``store`` (``stream``
    "off": a staged image, which a restore pulls into staging): its image."""
    job = await start_job(LONG_JOB, "train", state_dir=host.state)
    try:
        done = await operations.checkpoint(
            job, store, mode=Mode.EXIT, settings=host.checkpoint_settings(stream=stream),
            image_settings=ImageSettings(),
        )  # fmt: skip
    finally:
        _kill_copies()
    return done.image_url


def _kill_copies() -> None:
    for pid in _copies():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def _restore_then_die(host: Host, url: str, step: str) -> list[int]:
    """Restore ``url`` in a child process killed right before ``step`` (see above); the
    pids of the job's copies it left."""
    settings = {"state_dir": str(host.state), "shm_dir": str(host.shm), "criu": host.criu}
    died = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _RESTORE_THEN_DIE, url, step, json.dumps(settings)
    )
    assert await died.wait() == -signal.SIGKILL
    return sorted(_copies())


@pytest.mark.parametrize("step", ["nccl_rebuild", "finish"])
async def test_agent_killed_after_criu_restored_its_assignment_finishes_that_restore_once(
    host: Host, sink: EventSink, tmp_path: Path, step: str
) -> None:
    """Killed after CRIU brought the job back but before the restore's last steps (the job's
    record naming the new process): the old agent found no restored job and restored the
    image a second time — two copies, both appending to the job's output. Now the restore's
    crash marker lets the next agent finish the first restore, and it is reported once."""
    store = f"file://{tmp_path}/store"
    url = await _exit_image(host, store)
    try:
        a = Assignment(job="train", image_url=url, store=store, controller_url=sink.url)
        path = tmp_path / "assignment.json"
        path.write_text(a.user_data())
        RestoreRecords(StateDir(host.state).assignments).save(
            RestoreProgress.of(a, RestoreStep.RESTORING, started=time.time())
        )
        first = await _restore_then_die(host, a.image_url, step)  # back, its record not
        assert first, "CRIU's restore had not run"
        root = await _agent_restores_once(host, sink, store, path, first)
        assert root in first or set(proctree.tree(root)) & set(first), (root, first)
        assert "restoring" not in sink.kinds("train")  # no second attempt began
        assert resolve_job("train", state_dir=host.state).pid == root
        assert all(proc_state(p) in ("S", "R") for p in first)  # running, not left stopped
    finally:
        _kill_copies()


async def test_a_restore_run_again_after_one_killed_midway_finishes_it_instead_of_a_copy(
    host: Host, tmp_path: Path
) -> None:
    """``spotguard restore`` killed after CRIU brought the job back, then run again: the
    first restore is finished (the job continued, its record naming it) and the second is
    refused as the job already running here — not a second copy."""
    url = await _exit_image(host, f"file://{tmp_path}/store")
    try:
        first = await _restore_then_die(host, url, "finish")
        assert first, "CRIU's restore had not run"
        with pytest.raises(PreflightError, match="already running here"):
            await operations.restore(
                url, settings=host.checkpoint_settings(),
                image_settings=ImageSettings(), job_name="train",
            )  # fmt: skip
        assert sorted(_copies()) == first
        running = resolve_job("train", state_dir=host.state)
        assert running.running() and running.pid in first
    finally:
        _kill_copies()


async def test_the_image_a_killed_restore_staged_is_removed_by_the_next_restore(
    host: Host, tmp_path: Path
) -> None:
    """Killed after it pulled a staged image into tmpfs, before CRIU: the pulled image (as
    large as the job) stayed there for good. The next restore removes it first (so does the
    agent at start), then restores the job."""
    url = await _exit_image(host, f"file://{tmp_path}/store", stream="off")
    try:
        assert await _restore_then_die(host, url, "put_files") == []  # nothing restored
        [left] = list(host.shm.glob("restore-*"))
        done = await operations.restore(
            url, settings=host.checkpoint_settings(), image_settings=ImageSettings(),
            job_name="train",
        )  # fmt: skip
        assert not left.exists(), "the killed restore's staged image is still there"
        assert list(host.shm.glob("restore-*")) == []  # nor this one's, once it ran
        assert done.job.running()
    finally:
        _kill_copies()
