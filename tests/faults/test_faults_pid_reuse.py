"""PID reuse (issue 31, item 5): the freeze marker of an agent that died names its pid; once
an unrelated process is given that pid, the old code took the marker for a freeze still in
progress and refused every later checkpoint ("another freeze is in progress"). The marker
now names its writer by pid *and* start time (``/proc/PID/stat``), so a reused pid is seen
for what it is. The reuse is forced with ``/proc/sys/kernel/ns_last_pid``; real CRIU, a real
job, a real ``file://`` store.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from spotguard import operations
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, list_jobs, start_job
from spotguard.checkpoint.marker import FreezeMarker
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.contracts import Mode
from spotguard.image import ImageSettings

pytestmark = [pytest.mark.criu, pytest.mark.timeout(120)]

LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
DEMO = [sys.executable, "-m", "spotguard.demo.job", "--gpu", "no", "--mb", "4"]
LONG = [*DEMO, "--steps", "100000", "--step-seconds", "0.02"]
WRITER = (
    "import sys; from pathlib import Path\n"
    "from spotguard.checkpoint.jobs import resolve_job\n"
    "from spotguard.checkpoint.marker import FreezeMarker, Op\n"
    "from spotguard.modes import Mode\n"
    "FreezeMarker(resolve_job('victim', state_dir=Path(sys.argv[1]))).take(Op.FREEZE, Mode.EXIT)\n"
)


@pytest.fixture
async def job(settings: CheckpointSettings) -> AsyncIterator[JobInfo]:
    j = await start_job(LONG, "victim", state_dir=settings.state_dir)
    yield j
    for k in list_jobs(settings.state_dir):
        if proctree.alive(k.pid):
            proctree.signal_all([k.pid], signal.SIGKILL)


def _stranger_with_pid(pid: int) -> subprocess.Popen[bytes]:
    """An unrelated process given ``pid`` (ns_last_pid set just before the fork; retried
    while another process of the host takes it first)."""
    for _ in range(200):
        LAST_PID.write_text(str(pid - 1))
        proc = subprocess.Popen(["/bin/sleep", "60"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    pytest.fail(f"could not get pid {pid} again")


async def test_a_freeze_marker_whose_pid_was_reused_does_not_block_checkpoints(
    settings: CheckpointSettings, job: JobInfo, tmp_path: Path
) -> None:
    if not os.access(LAST_PID, os.W_OK):
        pytest.skip("ns_last_pid is not writable here")
    # an agent took the marker and was killed (it never cleared it)
    writer = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WRITER, str(settings.state_dir)
    )
    assert await writer.wait() == 0
    record = FreezeMarker(job).read()
    assert record is not None and record.agent_pid is not None
    stranger = _stranger_with_pid(record.agent_pid)
    try:
        assert proctree.alive(record.agent_pid)  # the pid is in use again, by a stranger
        await asyncio.sleep(0.1)
        result = await operations.checkpoint(
            job, f"file://{tmp_path}/store", mode=Mode.RESUME, settings=settings,
            image_settings=ImageSettings(), stream="off",
        )  # fmt: skip
        assert result.image_url and proctree.alive(job.pid)
        assert stranger.poll() is None  # the stranger is left alone
    finally:
        stranger.kill()
        stranger.wait()
