"""The crash marker (``operation.json``) is typed: its ``op`` an :class:`Op`, its ``mode`` a
:class:`Mode` for a freeze and ``None`` for every other op. Markers written by the previous
format — ``mode`` a string that held the freeze's mode or the op's own name — are read as
they were meant, and :meth:`Engine.recover` acts on them as before: a real stopped process
(a resume killed midway) is continued and its park record removed. CRIU is not run
(the engine is built with the suite's).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotguard.checkpoint import procfacts
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.marker import MARKER, FreezeMarker, Op
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.modes import Mode
from spotguard.statedir import StateDir

#: markers in the previous format, each with the (op, mode) it is read as
OLD_SHAPES: list[tuple[dict[str, Any], Op, Mode | None]] = [
    ({"op": "freeze", "mode": "exit"}, Op.FREEZE, Mode.EXIT),
    ({"op": "freeze", "mode": "resume"}, Op.FREEZE, Mode.RESUME),
    ({"op": "suspend", "mode": "suspend", "record": "/x/parked.json"}, Op.SUSPEND, None),
    ({"op": "resume", "mode": "resume", "record": "/x/parked.json"}, Op.RESUME, None),
    ({"op": "restore", "mode": "restore", "images": "/x/img"}, Op.RESTORE, None),
    ({"mode": "exit"}, Op.FREEZE, Mode.EXIT),  # before ``op`` existed: a freeze's
]


def _job(tmp_path: Path, pid: int) -> JobInfo:
    job = JobInfo(name="train", pid=pid, dir=StateDir(tmp_path / "state").job("train"))
    job.dir.mkdir(parents=True)
    return job


def _dead_writer() -> tuple[int, int | None]:
    """The pid and start time of a process that has exited (a killed agent)."""
    proc = subprocess.Popen(["/bin/sleep", "0.2"])
    started = procfacts.start_time(proc.pid)
    proc.wait()
    return proc.pid, started


@pytest.mark.parametrize(("body", "op", "mode"), OLD_SHAPES)
def test_a_marker_of_the_previous_format_reads_typed(
    tmp_path: Path, body: dict[str, Any], op: Op, mode: Mode | None
) -> None:
    job = _job(tmp_path, os.getpid())
    old = {"agent_pid": 1, "job_pid": job.pid, "started": "", "gpu_pids": [7], "tree": [1, 7]}
    (job.dir / MARKER).write_text(json.dumps({**old, **body}))
    rec = FreezeMarker(job).read()
    assert rec is not None
    assert (rec.op, rec.mode) == (op, mode)
    assert type(rec.op) is Op and (mode is None or type(rec.mode) is Mode)
    assert (rec.gpu_pids, rec.tree) == ([7], [1, 7])


def test_a_marker_is_written_with_its_op_and_only_a_freeze_with_a_mode(tmp_path: Path) -> None:
    job = _job(tmp_path, os.getpid())
    marker = FreezeMarker(job)
    marker.take(Op.FREEZE, Mode.EXIT)
    data = json.loads((job.dir / MARKER).read_text())
    assert (data["op"], data["mode"]) == ("freeze", "exit")
    marker.clear()
    marker.take(Op.SUSPEND, record=tmp_path / "parked.json")
    data = json.loads((job.dir / MARKER).read_text())
    assert (data["op"], data["mode"], data["record"]) == (
        "suspend",
        None,
        str(tmp_path / "parked.json"),
    )
    with pytest.raises(ValueError, match="exactly when it is a freeze"):
        FreezeMarker(job).take(Op.FREEZE)
    with pytest.raises(ValueError, match="exactly when it is a freeze"):
        FreezeMarker(job).take(Op.RESUME, Mode.RESUME)


@pytest.fixture
def stopped() -> Iterator[subprocess.Popen[bytes]]:
    """A real process stopped as a suspend leaves a job (SIGSTOP), killed at the end."""
    proc = subprocess.Popen(["/bin/sleep", "60"])
    os.kill(proc.pid, signal.SIGSTOP)
    yield proc
    proc.kill()
    proc.wait()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def test_recover_acts_on_a_marker_of_the_previous_format(
    tmp_path: Path, stopped: subprocess.Popen[bytes], criu_bin: str
) -> None:
    """A resume killed midway, its marker in the old shape (``"mode": "resume"`` the op's
    name): the job is continued, its park record removed, the marker gone."""
    job = _job(tmp_path, stopped.pid)
    record = tmp_path / "parked.json"
    record.write_text("{}")
    agent, agent_start = _dead_writer()
    old = {
        "mode": "resume", "op": "resume", "agent_pid": agent, "agent_start": agent_start,
        "job_pid": job.pid, "started": "2025-05-01T12:00:00+00:00", "gpu_pids": [],
        "tree": [job.pid], "record": str(record),
    }  # fmt: skip
    (job.dir / MARKER).write_text(json.dumps(old))
    assert _state(job.pid) == "T"
    settings = CheckpointSettings(
        state_dir=tmp_path / "state", shm_dir=tmp_path / "shm", criu=criu_bin
    )
    assert await Engine(Criu(criu_bin), settings=settings).recover(job)
    assert _state(job.pid) in ("S", "R")
    assert not record.exists() and not (job.dir / MARKER).exists()


@pytest.mark.parametrize("pending", [True, False], ids=["memory-not-back", "memory-back"])
async def test_a_restore_killed_before_its_staged_memory_was_back_is_undone(
    tmp_path: Path, stopped: subprocess.Popen[bytes], criu_bin: str, pending: bool
) -> None:
    """A park's restore killed after CRIU restored the tree (its processes left stopped)
    but before the GPU memory carried beside CRIU was written back: bringing that tree back
    would hand the driver a range of zeros for the job's GPU memory. It is killed instead and
    the job stays parked (the next unpark restores it whole). Once the memory was back, the
    restore is finished as before."""
    job = _job(tmp_path, stopped.pid)
    kept = tmp_path / "parked.json"
    kept.write_text("{}")
    images = tmp_path / "images"
    images.mkdir()
    agent, agent_start = _dead_writer()
    (job.dir / MARKER).write_text(json.dumps({
        "op": "restore", "agent_pid": agent, "agent_start": agent_start, "job_pid": job.pid,
        "started": "2026-11-26T12:00:00+00:00", "gpu_pids": [], "tree": [job.pid],
        "record": str(kept), "images": str(images),
        "job_start": procfacts.start_time(job.pid), "pages_pending": pending,
    }))  # fmt: skip
    settings = CheckpointSettings(
        state_dir=tmp_path / "state", shm_dir=tmp_path / "shm", criu=criu_bin
    )
    assert await Engine(Criu(criu_bin), settings=settings).recover(job)
    assert not (job.dir / MARKER).exists()
    if pending:
        stopped.wait(timeout=10)  # killed
        assert kept.exists() and images.exists(), "the parked job's record and image went"
    else:
        assert _state(job.pid) in ("S", "R")  # continued, the restore finished
        assert not kept.exists() and not images.exists()
