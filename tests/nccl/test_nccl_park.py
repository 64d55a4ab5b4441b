"""A job with NCCL communicators parked in memory (suspended in place) and unparked: its
communicators are released before the GPU lock and rebuilt after the resume, as for a freeze
(the driver's checkpoint must never meet NCCL's shared transports), on the fake NCCL (CPU)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from ckpt_helpers import Launch, lines, wait_exit, wait_for
from test_nccl_release import STEP_MS, _log_count, _reference, _settings

from conftest import Built
from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine
from spotguard.checkpoint.suspend import stopped
from spotguard.park.core import park, unpark
from spotguard.park.settings import ParkSettings

pytestmark = pytest.mark.criu

RANKS, STEPS = 2, 150


async def test_a_job_parked_in_memory_releases_its_communicators_and_unpark_rebuilds_them(
    built: Built,
    launch_shim: Launch,
    criu_bin: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    want = _reference(built, tmp_path, ranks=RANKS, steps=STEPS)
    job = await launch_shim([str(built.job), str(RANKS), str(STEPS), str(STEP_MS)], "inmem")
    out = job.dir / "stdout"
    await wait_for(lambda: len(lines(out)) > 5, "the job's first steps")
    settings = _settings(tmp_path, criu_bin)
    engine = Engine(Criu(criu_bin), settings=settings)
    caplog.set_level(logging.INFO, logger="spotguard.checkpoint.ncclctl")

    rec = await park(job, to="memory", engine=engine, settings=settings,
                     park_settings=ParkSettings())  # fmt: skip
    assert rec.place == "memory"
    assert all(stopped(p) for p in proctree.tree(job.pid))
    # world and split of every rank released before the job was stopped
    assert _log_count(tmp_path, "finalize") == 2 * RANKS
    assert _log_count(tmp_path, "destroy") == 2 * RANKS
    await unpark(job.name, engine=engine, settings=settings, park_settings=ParkSettings())
    # the world once by the job; world and split again by the rebuild, from fresh ids
    await wait_for(lambda: _log_count(tmp_path, "init") == RANKS + 2 * RANKS, "the rebuild")
    assert _log_count(tmp_path, "wrong-device") == 0
    assert await wait_exit(job, 60) == 0, (job.dir / "stderr").read_text()
    assert lines(out) == want
    msgs = [r for r in caplog.records if r.getMessage().startswith("NCCL communicators")]
    assert [r.getMessage() for r in msgs] == [
        "NCCL communicators released",
        "NCCL communicators rebuilt",
    ]
    assert all(getattr(r, "communicators") == 2 * RANKS for r in msgs)  # noqa: B009
