"""Helpers shared by the park tests (imported by name; conftest modules are not)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sgtest import free_port as free_port

JOBS = str(Path(__file__).with_name("park_jobs.py"))

Sg = Callable[..., subprocess.CompletedProcess[str]]


def ok_json(res: subprocess.CompletedProcess[str]) -> Any:
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr}"
    return json.loads(res.stdout.strip().splitlines()[-1])
