"""A failed freeze brings the job back; a process of it that is gone by then is named.

A process can die while CRIU holds it: killed from outside, or left at a breakpoint with
no one tracing it when CRIU itself was killed while it set up or took out its parasite
(checkpoint/criu.py). The bring-back resumes what is left; an operator reading "job
resumed" must also learn that part of the job did not come back.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.settings import CheckpointSettings


@pytest.fixture
def held_and_gone() -> Iterator[tuple[int, int]]:
    """Two processes of a job: one stopped (held), one killed and reaped (gone)."""
    kept = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(kept.pid, signal.SIGSTOP)
        gone.kill()
        gone.wait()
        yield kept.pid, gone.pid
    finally:
        kept.kill()
        kept.wait()


async def test_bring_back_names_the_processes_of_the_job_that_are_gone(
    criu_bin: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, held_and_gone: tuple[int, int]
) -> None:
    kept, gone = held_and_gone
    job = JobInfo("lost-one", kept, tmp_path)
    engine = Engine(Criu(criu_bin), settings=CheckpointSettings(state_dir=tmp_path / "s"))
    with caplog.at_level(logging.ERROR, logger="spotguard.checkpoint.engine"):
        await engine.bring_back(job, [kept, gone], [], reopen_nccl=False)
    assert psutil.Process(kept).status() != psutil.STATUS_STOPPED
    said = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in said] == ["processes of the job are gone: not brought back"]
    assert getattr(said[0], "pids", None) == [gone]
    assert getattr(said[0], "job", None) == "lost-one"
