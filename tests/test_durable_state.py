"""Node state a restarted agent relies on reaches the disk: the file and the directory that
names it are fsync'd before the write returns (a power loss right after a freeze marker or a
job record was written must not lose it, nor leave an empty file under its name).

``os.fsync`` is the boundary with the kernel, not spotguard's code: it is wrapped to record
which inodes were synced (and then still called), on a real file system.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spotguard import safefs
from spotguard.agent.ledger import Ledger
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.marker import FreezeMarker, Op
from spotguard.modes import Mode

Inode = tuple[int, int]


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[Inode]:
    """The (device, inode) of every fd passed to ``os.fsync``, in order."""
    seen: list[Inode] = []
    real = os.fsync

    def record(fd: int) -> None:
        st = os.fstat(fd)
        seen.append((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return seen


def _inode(path: Path) -> Inode:
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def test_freeze_marker_is_fsynced_with_its_directory(tmp_path: Path, synced: list[Inode]) -> None:
    job = JobInfo(name="train", pid=os.getpid(), dir=tmp_path / "job")
    job.dir.mkdir()
    FreezeMarker(job).take(Op.FREEZE, Mode.EXIT)
    marker = job.dir / "operation.json"
    assert marker.is_file()
    assert _inode(marker) in synced, "the marker's content was not fsync'd"
    assert _inode(job.dir) in synced, "the job directory (the marker's name) was not fsync'd"


def test_ledger_record_is_fsynced_with_its_directory(tmp_path: Path, synced: list[Inode]) -> None:
    folder = tmp_path / "jobs"
    Ledger(folder).put("train", os.getpid(), "protecting")
    record = folder / "train.json"
    assert Ledger(folder).get("train") is not None
    assert _inode(record) in synced, "the job record's content was not fsync'd"
    assert _inode(folder) in synced, "the ledger directory was not fsync'd"


def test_write_atomic_keeps_the_mode_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")
    safefs.write_atomic(target, b"new", mode=0o640)
    assert target.read_bytes() == b"new"
    assert os.stat(target).st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_write_atomic_default_mode_is_what_open_creates(tmp_path: Path) -> None:
    """Without ``mode`` the file gets what ``open(path, "w")`` would give it (0666 less the
    umask), as the plain writers it replaces did."""
    umask = os.umask(0o022)
    try:
        safefs.write_atomic(tmp_path / "a", b"x")
    finally:
        os.umask(umask)
    assert os.stat(tmp_path / "a").st_mode & 0o777 == 0o644


def test_write_atomic_does_not_follow_a_link_at_the_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "state.json").symlink_to(victim)
    safefs.write_atomic(tmp_path / "state.json", b"new")
    assert victim.read_text() == "keep"
    assert not (tmp_path / "state.json").is_symlink()
    assert (tmp_path / "state.json").read_bytes() == b"new"
