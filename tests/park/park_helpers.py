"""Helpers shared by the park tests (imported by name; conftest modules are not)."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

JOBS = str(Path(__file__).with_name("park_jobs.py"))

Sg = Callable[..., subprocess.CompletedProcess[str]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ok_json(res: subprocess.CompletedProcess[str]) -> Any:
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr}"
    return json.loads(res.stdout.strip().splitlines()[-1])
