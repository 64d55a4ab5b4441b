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

from sgtest import held_in_pid_namespace, run_in_pid_namespace
from spotguard import workdirs
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
    ns = workdirs.pid_namespace()
    dead = [settings.shm_dir / f"restore-{pid}-{started}-{ns}-0a1b2c3d",
            settings.disk_staging_dir / f"restore-{pid}-{started}-{ns}-deadbeef"]  # fmt: skip
    live = settings.shm_dir / f"{_owned_prefix()}11223344"
    others = [
        settings.shm_dir / "restore-5e6f7a8b",  # an older naming: nobody's to judge
        settings.shm_dir / f"restore-{pid}-{started}-9a8b7c6d",  # no namespace: as old
        settings.shm_dir / f"restore-{pid}-{started}-{ns + 1}-9a8b7c6d",  # another namespace
    ]
    for d in (*dead, live, *others):
        d.mkdir(parents=True)
        (d / "pages-1.img").write_bytes(os.urandom(4096))
    assert sorted(clear_orphans(settings)) == sorted(dead)
    assert not any(d.exists() for d in dead)
    assert live.exists() and all(d.exists() for d in others)
    assert clear_orphans(settings) == []


def test_a_restore_names_its_staged_image_after_itself() -> None:
    ns = workdirs.pid_namespace()
    assert _owned_prefix() == f"restore-{os.getpid()}-{start_time('self')}-{ns}-"


def test_a_live_restore_in_another_pid_namespace_keeps_its_staged_image(tmp_path: Path) -> None:
    """An agent in a container (a PID namespace of its own) sharing the staging tmpfs saw
    none of the host's restores and removed their staged images as orphans, and the host
    removed the container's: only a restore of the remover's own namespace is judged."""
    settings = CheckpointSettings(state_dir=tmp_path / "state", shm_dir=tmp_path / "shm")
    mine = settings.shm_dir / f"{_owned_prefix()}11223344"  # the host's restore, staging
    mine.mkdir(parents=True)
    removed = run_in_pid_namespace(
        "import sys; from pathlib import Path\n"
        "from spotguard.checkpoint.settings import CheckpointSettings\n"
        "from spotguard.operations.restore import clear_orphans\n"
        "s = CheckpointSettings(state_dir=Path(sys.argv[1]), shm_dir=Path(sys.argv[2]))\n"
        "print(len(clear_orphans(s)))\n",
        str(tmp_path / "ns-state"), str(settings.shm_dir),
    )  # fmt: skip
    assert removed == "0" and mine.is_dir(), "another PID namespace removed a live restore's image"
    with held_in_pid_namespace(
        "import sys, time; from pathlib import Path\n"
        "from spotguard.operations.restore import _owned_prefix\n"
        "d = Path(sys.argv[1]) / (_owned_prefix() + '55667788'); d.mkdir()\n"
        "print(d, flush=True); time.sleep(60)\n",
        str(settings.shm_dir),
    ) as made:
        theirs = Path(made)
        assert theirs.is_dir()
        assert clear_orphans(settings) == []
        assert theirs.is_dir(), "the host removed a live restore's image of a PID namespace"
