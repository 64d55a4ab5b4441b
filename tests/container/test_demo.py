"""``spotguard demo --container``: the CLI's side. The demo's scenario itself runs in
test_agent.py (with checks between its steps); here, a host without podman gets one line
naming what to install, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sgtest import without_spotguard_settings

SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))


def test_container_demo_without_podman_says_what_to_install_and_starts_nothing(
    tmp_path: Path,
) -> None:
    work = tmp_path / "demo"
    env = without_spotguard_settings(SPOTGUARD_CONTAINER_PODMAN=str(tmp_path / "no-podman"))
    out = subprocess.run(
        [SPOTGUARD, "demo", "--container", "--workdir", str(work)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"podman {str(tmp_path / 'no-podman')!r} is not an executable" in out.stderr
    assert not work.exists() or not any(work.iterdir())
