"""A job that forks short-lived children (issue 31, item 6): a shell loop that starts a
process every few milliseconds, and a Python program that forks (``os.fork``) as often. The
freeze preflight reads every process of the tree from /proc; a child that exited between the
listing and the read made the scan fail ("JobNotFound: no process N") in about half the
tries, with no retry within the notice. The scan now leaves out what exits while it reads
(such a process is not part of the dump: CRIU freezes the tree itself and dumps what exists
then), so every checkpoint succeeds — real CRIU, a real ``file://`` store, 20 in a row
staged (the shell loop), 8 in a row with ``stream="auto"`` (the Python job: streamed where
CRIU can), and the job is running after each.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sgtest import until
from spotguard import operations
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, list_jobs, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.contracts import Mode
from spotguard.image import ImageSettings
from spotguard.operations.checkpoint import StreamChoice

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]

IMG = ImageSettings(chunk_size=1 << 20, workers=1, max_inflight_mb=4)
#: forks a child every ~5 ms (each ``sleep`` and ``true`` is a process that exits at once)
FORKER = ["/bin/sh", "-c", "i=0; while :; do sleep 0.005; /bin/true; i=$((i+1)); echo $i; done"]
#: a Python program forking a child every ~3 ms (the child exits at once, is reaped)
PY_FORKER = [
    sys.executable, "-c",
    "import os, time\ni = 0\nwhile True:\n    pid = os.fork()\n    if pid == 0:\n"
    "        os._exit(0)\n    os.waitpid(pid, 0)\n    i += 1\n    print(i, flush=True)\n"
    "    time.sleep(0.003)\n",
]  # fmt: skip
JOBS = {"sh": FORKER, "python": PY_FORKER}


@pytest.fixture
async def forker(
    settings: CheckpointSettings, request: pytest.FixtureRequest
) -> AsyncIterator[JobInfo]:
    j = await start_job(JOBS[request.param], "forker", state_dir=settings.state_dir)
    yield j
    for k in list_jobs(settings.state_dir):
        if proctree.alive(k.pid):
            proctree.signal_all([k.pid], signal.SIGKILL)


def _count(p: Path) -> int:
    lines = p.read_text().split() if p.exists() else []
    return int(lines[-1]) if lines else 0


@pytest.mark.parametrize(
    ("forker", "stream", "rounds"),
    [("sh", "off", 20), ("python", "auto", 8)],
    indirect=["forker"],
)
async def test_checkpoints_in_a_row_of_a_job_forking_every_few_ms(
    settings: CheckpointSettings, forker: JobInfo, tmp_path: Path, stream: StreamChoice, rounds: int
) -> None:
    store = f"file://{tmp_path}/store"
    out = forker.dir / "stdout"
    await until(lambda: _count(out) >= 20, "the forking job to get going", 30)
    failures: list[str] = []
    for n in range(rounds):
        try:
            await operations.checkpoint(
                forker, store, mode=Mode.RESUME, settings=settings, image_settings=IMG,
                stream=stream,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - counted and shown
            failures.append(f"{n}: {type(exc).__name__}: {exc}")
        assert proctree.alive(forker.pid), f"checkpoint {n} left the job dead"
    assert failures == [], failures
    before = _count(out)
    # still forking, not left stopped
    await until(lambda: _count(out) > before + 5, "the job to make progress", 10)
