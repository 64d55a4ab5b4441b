"""Run by tests/test_isolation.py as a pytest session of its own (not collected otherwise)."""

from __future__ import annotations

import os
import subprocess


def test_no_spotguard_setting_reaches_a_test() -> None:
    leaked = sorted(k for k in os.environ if k.startswith("SPOTGUARD_") and k != "SPOTGUARD_CRIU")
    print("SPOTGUARD_* seen:", leaked)
    assert "SPOTGUARD_STATE_DIR" not in os.environ
    assert "SPOTGUARD_STORE" not in os.environ
    assert os.environ.get("SPOTGUARD_REQUIRE_CRIU") == "0", "a harness variable is kept"


def test_leaves_a_detached_process_behind() -> None:
    if os.environ.get("PROBE_LEAVE") != "1":
        return
    # as a forgotten `spotguard run` job would: its own session, never waited for
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    with open(os.environ["PROBE_PIDFILE"], "w") as f:
        f.write(str(proc.pid))
