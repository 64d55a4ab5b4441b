"""Running ``spotguard`` as an operator would: as a console script, without an extra (its
modules made unimportable), or as an unprivileged user."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sgtest import free_port as free_port

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
HERE = Path(__file__).resolve().parent


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any SPOTGUARD_* setting (plus ``extra``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env["SPOTGUARD_CONFIG"] = os.devnull  # never the host's /etc/spotguard/spotguard.toml
    env.update(extra)
    return env


def sg(
    *args: str,
    without: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """``spotguard ARGS``; with ``without``, those top-level modules cannot be imported (an
    install without that extra)."""
    argv = ["spotguard", *args]
    if without:
        argv = [sys.executable, str(HERE / "without.py"), ",".join(without), *args]
    return subprocess.run(
        argv, capture_output=True, text=True, env=env or clean_env(), timeout=timeout
    )


def as_nobody(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``spotguard ARGS`` as uid/gid 65534, run by the system's python3 with this tree's
    sources and the test environment's packages (whose interpreter lives in root's home)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    python = shutil.which("python3", path="/usr/bin:/usr/local/bin")
    setpriv = shutil.which("setpriv")
    if python is None or setpriv is None:
        pytest.skip("needs /usr/bin/python3 and setpriv")
    site = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    env = clean_env(PYTHONPATH=f"{SRC}:{site}", HOME=str(cwd))
    return subprocess.run(
        [
            setpriv,
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            python,
            "-m",
            "spotguard",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=60,
    )
