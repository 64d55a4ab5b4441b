"""Fixtures for the streaming tests: a deterministic job and its uninterrupted output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from stream_helpers import JOB, MIB, STEPS


@pytest.fixture(scope="session")
def job_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("job") / "stream_job.py"
    path.write_text(JOB)
    return path


@pytest.fixture(scope="session")
def reference_output(job_script: Path) -> str:
    """What the job prints when nothing interrupts it."""
    out = subprocess.run(
        [sys.executable, str(job_script), str(STEPS), str(MIB)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return out.stdout
