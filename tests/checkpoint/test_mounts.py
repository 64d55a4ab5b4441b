"""The mount records of an image (checkpoint/mounts.py) without CRIU: what the dump records
from mountinfo, which mount records an image may hold, and what a restoring host is checked
for — on real files, this process's real mountinfo and real directories. The whole path,
with real bind mounts and real CRIU, is tests/faults/test_faults_mounts.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from spotguard.checkpoint import mounts
from spotguard.checkpoint.meta import ImageMeta
from spotguard.errors import ImageError, MissingMount


def _rec(
    mountpoint: str,
    source: str,
    *,
    key: str = "sg-mnt-0",
    parent: str = "/",
    used: bool = False,
    source_is_mount: bool = False,
) -> mounts.JobMount:
    return mounts.JobMount(
        key, mountpoint, source, parent, True, used=used, source_is_mount=source_is_mount
    )


def test_mountinfo_escapes_and_the_host_path_of_a_bind_of_a_subdirectory(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "20 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        "30 20 8:1 /srv/my\\040data /data rw shared:4 - ext4 /dev/sda1 rw\n"
    )
    root, data = mounts.read_mountinfo(str(info))
    assert data.root == "/srv/my data" and data.mountpoint == "/data"
    assert data.propagation == ("shared:4",)
    # the job's copy of /data: the host mount at the same place is what it shows
    assert mounts._host_source(data, [root, data]) == ("/data", True)
    # that host mount gone: the same content is the directory within the host's root mount
    assert mounts._host_source(data, [root]) == ("/srv/my data", False)
    # another device: not the host's (the job's own mount)
    other = mounts.MountLine(31, 20, "0:99", "/", "/scratch", "tmpfs")
    assert mounts._host_source(other, [root, data]) is None


def test_this_process_mountinfo_reads_with_root_and_proc() -> None:
    lines = mounts.read_mountinfo("/proc/self/mountinfo")
    assert any(m.mountpoint == "/" for m in lines)
    assert all(m.mountpoint.startswith("/") for m in lines)


@pytest.mark.parametrize(
    "bad",
    [
        {"mountpoint": "data"},
        {"mountpoint": "/a/../etc"},
        {"source": "/x\0y"},
        {"key": "sg-mnt-1]:/etc"},
        {"key": "other"},
    ],
)
def test_a_malformed_mount_record_makes_the_image_metadata_unreadable(
    bad: dict[str, str], tmp_path: Path
) -> None:
    rec = {**_rec("/data", "/data").to_json(), **bad}
    with pytest.raises(ValueError):
        mounts.JobMount.from_json(rec)
    good = _rec("/data", "/data").to_json()
    meta = {"job": {"name": "j"}, "mode": "exit", "criu_version": "4.2.1", "mounts": [good]}
    meta["host"] = {"arch": "x86_64", "kernel": "6.1", "memory_total": 1 << 30}
    (tmp_path / "spotguard-image.json").write_text(json.dumps(meta))
    assert ImageMeta.read(tmp_path).mounts == [_rec("/data", "/data")]
    (tmp_path / "spotguard-image.json").write_text(json.dumps({**meta, "mounts": [good, rec]}))
    with pytest.raises(ImageError, match="mount record"):
        ImageMeta.read(tmp_path)


def test_a_used_mount_is_checked_an_unused_one_is_not(tmp_path: Path) -> None:
    gone = str(tmp_path / "gone")
    with pytest.raises(MissingMount, match=f"uses the mount at {gone}, and {gone} does not"):
        mounts.check([_rec(gone, gone, used=True)], job="j")
    mounts.check([_rec(gone, gone, used=False)])
    # a bare directory where the dump host had a mount is the mount's absence
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(MissingMount, match=f"nothing is mounted at {bare} here"):
        mounts.check([_rec(str(bare), str(bare), used=True, source_is_mount=True)])
    mounts.check([_rec(str(bare), str(bare), used=True, source_is_mount=False)])


def test_an_unused_absent_mount_gets_an_empty_stand_in_and_its_mountpoint_is_removed_after(
    tmp_path: Path,
) -> None:
    mp = tmp_path / "made" / "here"
    recs = [
        _rec(str(mp), str(tmp_path / "src"), key="sg-mnt-0"),
        _rec(str(mp / "inner"), str(tmp_path / "inner-src"), key="sg-mnt-1", parent=str(mp)),
        _rec("/proc", "/proc", key="sg-mnt-2", used=True, source_is_mount=True),
    ]
    with mounts.planned(recs, job="j") as plan:
        binds = dict(a.removeprefix("mnt[").split("]:", 1) for a in plan.args[1::2])
        assert binds["sg-mnt-2"] == "/proc"
        stand_in = Path(binds["sg-mnt-0"])
        # empty but for the mountpoint of the mount on it: made in the stand-in, not the host
        assert os.listdir(stand_in) == ["inner"]
        assert mp.is_dir()  # made on the host for CRIU
        assert Path(binds["sg-mnt-1"]).parent == stand_in.parent
    assert not (tmp_path / "made").exists()
    assert not stand_in.exists()
    assert os.listdir(tmp_path) == []
