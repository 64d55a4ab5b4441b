"""A mount absent on the restoring host (issue 31, item 15).

A ``spotguard run`` job has its own mount namespace, a copy of the host's: every mount the
host had when the job started is in its image, and CRIU bound each one again at restore from
the host's path. A bind mount the job never used, gone from the restoring host, failed the
restore ("mnt-v2: Failed to open_tree … No such file", or "Can't stat mountpoint"): the image
could never come back there. Now the image names the mounts the job uses (its open files,
mapped files, working and root directories, and the mounts they sit on): one of those absent
refuses the restore in its preflight, before any file is written or process created, naming
the mount; any other absent mount comes back empty (left out where its mountpoint is absent
too), with one log line.

Real CRIU, real jobs, a real ``file://`` store, real bind mounts: the whole run happens in a
private mount namespace (``unshare -m``, tests/faults/sg_mount_restore.py) so that the mounts
never reach the host or another test's jobs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.criu, pytest.mark.timeout(120)]

SCRIPT = Path(__file__).with_name("sg_mount_restore.py")
STEPS = 150  # as sg_mount_restore.STEPS


@pytest.fixture(scope="module")
def run(criu_bin: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One run of the scenario (two jobs, one checkpoint and one restore each)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    root = tmp_path_factory.mktemp("mounts")
    cmd = ["unshare", "-m", "--propagation", "private", sys.executable, str(SCRIPT)]
    proc = subprocess.run(
        [*cmd, str(root), criu_bin], capture_output=True, text=True, timeout=100, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_mount_the_job_never_used_absent_at_restore_comes_back_empty(
    run: tuple[Path, dict[str, Any]],
) -> None:
    root, out = run
    idle = out["idle"]
    assert idle["ok"], idle
    assert idle["exit"] == 0
    # the job went on where it stopped: every line once, in order, nothing lost or repeated
    assert idle["lines"] == [str(i) for i in range(STEPS)]
    for spare in ("gone/spare", "gone/spare/inner", "spare file", "data", "kept"):
        said = [r for r in out["log"] if r.get("mountpoint") == str(root / spare)]
        left = "restored empty" if spare == "kept" else "left out"
        assert said and said[-1]["msg"].endswith(f"not on this host: {left}"), out["log"]
    # where the host lacks the mountpoint too, the one made for the restore is removed after
    # it, which takes the empty mount out of the job's namespace: only "kept" stays mounted
    assert idle["mounted"] == [str(root / "kept")], idle["mounted"]
    assert out["left_on_host"] == ["kept", "shm", "state", "store"], out["left_on_host"]


def test_a_mount_the_job_uses_absent_at_restore_is_refused_before_anything_is_restored(
    run: tuple[Path, dict[str, Any]],
) -> None:
    root, out = run
    reader = out["reader"]
    assert not reader["ok"], reader
    assert reader["error"] == "MissingMount", reader
    assert str(root / "data") in reader["message"]
    assert "\n" not in reader["message"]
    assert reader["lines_after_refusal"] == 0
    failed = [r for r in out["log"] if r["msg"] == "restore failed"]
    assert failed and failed[0].get("step") == "preflight", out["log"]


def test_stale_copies_of_host_mounts_neither_fail_the_dump_nor_the_restore(
    criu_bin: str, tmp_path: Path
) -> None:
    """A job started while a container's network namespace and shm were mounted keeps copies
    of both once the container stops (the host unmounts them, their mountpoints stay). CRIU
    failed the dump on the namespace file ("doesn't have a proper root mount") and would
    restore the tmpfs copy at a mountpoint gone by then ("Can't stat mountpoint"). Both are
    now named to CRIU as host mounts and come back as empty stand-ins, left out."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    cmd = ["unshare", "-m", "--propagation", "private", sys.executable]
    proc = subprocess.run(
        [*cmd, str(SCRIPT.with_name("sg_stale_mounts.py")), str(tmp_path), criu_bin],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    netns, shm = str(tmp_path / "netns" / "cni-1234"), str(tmp_path / "userdata" / "shm")
    assert out["stale_in_job"] == [netns, shm]  # what a stopped container leaves in the job
    assert out["checkpoint"] == "ok"
    assert out["restore"] == "ok"
    assert out["exit"] == 0
    assert out["lines"] == [str(i) for i in range(STEPS)]
    for mountpoint in (netns, shm):
        said = [r for r in out["log"] if r.get("mountpoint") == mountpoint]
        assert said and said[-1]["msg"].endswith("not on this host: left out"), out["log"]
    assert "netns" not in out["left_on_host"] and "userdata" not in out["left_on_host"]
