"""Issue 28.6: the suite is isolated from the caller's SPOTGUARD_* settings and fails a run
that leaves a process behind. Each case runs a real pytest session of its own on
tests/probes/isolation_probe.py, under this suite's conftest."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "probes" / "isolation_probe.py"


def _session(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    full |= {"SPOTGUARD_REQUIRE_CRIU": "0"} | env
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(PROBE)],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_exported_state_dir_and_store_do_not_reach_the_tests(tmp_path: Path) -> None:
    out = _session(
        tmp_path,
        SPOTGUARD_STATE_DIR=str(tmp_path / "operator-state"),
        SPOTGUARD_STORE="file:///nonexistent",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cleared from the environment: SPOTGUARD_STATE_DIR, SPOTGUARD_STORE" in out.stdout
    assert not (tmp_path / "operator-state").exists()


def test_a_process_left_behind_fails_the_run_and_is_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    out = _session(tmp_path, PROBE_LEAVE="1", PROBE_PIDFILE=str(pidfile))
    pid = int(pidfile.read_text())
    assert out.returncode == 1, out.stdout + out.stderr
    assert "2 passed" in out.stdout, "every test passed: only the leftover fails the run"
    assert "leftover processes" in out.stdout and f"pid {pid} " in out.stdout, out.stdout
    assert "sleep 300" in out.stdout
    for _ in range(50):
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), "the leftover is killed"
