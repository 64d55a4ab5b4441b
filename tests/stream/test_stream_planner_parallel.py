"""The deadline planner is told when the CRIU at hand dumps a job's processes at once
(``--page-workers``, spotguard's patched CRIU): a checkpoint's plan then spreads the image
over the ranks and learns the host's combined rate. ``operations.checkpoint`` never said so,
so the planner's parallel model (unit-tested in test_stream_planner.py) was never used and
an N-rank job was always predicted as if dumped one process after another."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from spotguard import operations
from spotguard.checkpoint import proctree
from spotguard.checkpoint.criufind import has_page_workers
from spotguard.checkpoint.jobs import start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image import ImageSettings
from spotguard.modes import Mode

pytestmark = pytest.mark.criu

RANKS = """
import os, sys, time
for _ in range(2):
    if os.fork() == 0:
        data = bytearray(os.urandom(8 << 20))  # each rank holds memory of its own
        while True:
            time.sleep(0.05)
print("up", flush=True)
while True:
    time.sleep(0.05)
"""


async def test_a_checkpoint_plans_the_ranks_at_once_with_a_parallel_criu(
    criu_bin: str, tmp_path: Path
) -> None:
    if not has_page_workers(criu_bin):
        pytest.fail(f"{criu_bin} has no --page-workers: run scripts/install-criu (it builds it)")
    state = tmp_path / "state"
    settings = CheckpointSettings(state_dir=state, criu=criu_bin, shm_dir=tmp_path / "shm")
    job = await start_job([sys.executable, "-c", RANKS], "ranks", state_dir=state)
    try:
        for _ in range(200):
            if len(proctree.tree(job.pid)) >= 4:  # init, launcher, two ranks
                break
            await asyncio.sleep(0.05)
        result = await operations.checkpoint(
            job, f"file://{tmp_path}/store", mode=Mode.RESUME, settings=settings,
            image_settings=ImageSettings(), stream="off",
        )  # fmt: skip
        assert result.plan is not None
        assert result.plan["parallel"] is True, result.plan
        assert result.plan["estimate"]["processes"] >= 2, result.plan["estimate"]
    finally:
        proctree.signal_all(proctree.tree(job.pid), signal.SIGKILL)
