"""A restore killed while it staged or restored an image leaves the pulled image behind in
the staging directory (tens of GB of tmpfs on a GPU node). Staged images are named after the
process that pulled them; the agent at start, and every restore before it stages, removes
those whose process is gone — never one whose restore still runs, nor a directory of
another naming."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from spotguard.checkpoint.procfacts import start_time
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.operations.restore import _owned_prefix, clear_orphans


def _dead() -> tuple[int, int]:
    """The pid and start time of a process that has ended."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; print(os.getpid()); sys.stdout.flush(); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    started = start_time(pid)
    assert started is not None
    proc.communicate("\n", timeout=10)
    return pid, started


def test_only_the_images_of_killed_restores_are_removed(tmp_path: Path) -> None:
    settings = CheckpointSettings(state_dir=tmp_path / "state", shm_dir=tmp_path / "shm")
    pid, started = _dead()
    dead = [settings.shm_dir / f"restore-{pid}-{started}-0a1b2c3d",
            settings.disk_staging_dir / f"restore-{pid}-{started}-deadbeef"]  # fmt: skip
    live = settings.shm_dir / f"{_owned_prefix()}11223344"
    other = settings.shm_dir / "restore-5e6f7a8b"  # an older naming: nobody's to judge
    for d in (*dead, live, other):
        d.mkdir(parents=True)
        (d / "pages-1.img").write_bytes(os.urandom(4096))
    assert sorted(clear_orphans(settings)) == sorted(dead)
    assert not any(d.exists() for d in dead)
    assert live.exists() and other.exists()
    assert clear_orphans(settings) == []


def test_a_restore_names_its_staged_image_after_itself() -> None:
    assert _owned_prefix() == f"restore-{os.getpid()}-{start_time('self')}-"
