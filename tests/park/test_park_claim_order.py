"""A job started with a priority must carry it from the moment anything can see the job:
its claim (``priority.json``) was written after ``start_job`` had written ``job.json``, so an
agent's park policy (or another ``spotguard run --priority``) reading the job in between took
it for a priority-0 job and could park it to make room."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from spotguard.checkpoint.jobs import JobInfo, resolve_job
from spotguard.cli import main
from spotguard.park.priority import CLAIM_FILE, read_claim

pytestmark = pytest.mark.criu


def test_a_priority_run_has_its_claim_before_its_job_can_be_seen(
    config: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    save = JobInfo.save

    def watched(self: JobInfo) -> None:
        seen.append((self.dir / CLAIM_FILE).exists())
        save(self)

    monkeypatch.setattr(JobInfo, "save", watched)
    got = CliRunner().invoke(
        main,
        ["--config", str(config), "run", "--name", "hi", "--priority", "4", "--gpu-memory",
         "100M", "--json", "--", sys.executable, "-c", "import time; time.sleep(30)"],
    )  # fmt: skip
    assert got.exit_code == 0, got.output
    job = resolve_job("hi", state_dir=state_dir)
    try:
        assert json.loads(got.stdout.splitlines()[-1])["job"] == "hi"
        assert seen == [True], "the job could be seen before its priority"
        claim = read_claim(job.dir)
        assert (claim.priority, claim.gpu_bytes) == (4, 100 << 20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.pid, signal.SIGKILL)
