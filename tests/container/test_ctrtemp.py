"""Which of containerd's ``ctrd-checkpoint*`` directories a restore removes: only the new
one holding exactly the restored checkpoint's files — never another restore's, even of a
checkpoint that looks alike — with a real process named ``containerd`` whose environment
says where it unpacks."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.container.ctrtemp import CriuFiles, daemon_temp_dirs, removing_leftovers


def _checkpoint(d: Path, core: bytes) -> Path:
    d.mkdir(parents=True)
    (d / "inventory.img").write_bytes(b"\x01" * 86)
    (d / "core-1.img").write_bytes(core)
    (d / "pages-1.img").write_bytes(b"\x02" * 8192)
    (d / "descriptors.json").write_text('["/dev/null"]')
    return d


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Path]:
    """A running process named ``containerd`` whose ``TMPDIR`` is a directory of the test."""
    tmp = tmp_path / "daemon-tmp"
    tmp.mkdir()
    binary = tmp_path / "containerd"
    shutil.copy("/bin/sleep", binary)
    proc = subprocess.Popen([str(binary), "60"], env={"TMPDIR": str(tmp)})
    try:
        yield tmp
    finally:
        proc.kill()
        proc.wait()


def test_a_copy_is_recognised_by_its_files_and_core_bytes(tmp_path: Path) -> None:
    ours = CriuFiles.of_dir(_checkpoint(tmp_path / "ours", b"core-A" * 100))
    copy = _checkpoint(tmp_path / "copy", b"core-A" * 100)
    assert ours.matches(copy)
    (copy / "restore.log").write_text("CRIU's log, where a runtime put it")
    assert ours.matches(copy)
    twin = _checkpoint(tmp_path / "twin", b"core-B" * 100)  # same names and sizes
    assert not ours.matches(twin)
    (copy / "pages-2.img").write_bytes(b"\x03")
    assert not ours.matches(copy)


async def test_only_the_new_directory_of_the_restored_checkpoint_is_removed(
    tmp_path: Path, daemon: Path
) -> None:
    assert daemon in daemon_temp_dirs()
    ours = _checkpoint(tmp_path / "ours", b"core-A" * 100)
    older = _checkpoint(daemon / "ctrd-checkpoint1", b"core-A" * 100)  # there before: kept
    async with removing_leftovers(lambda: CriuFiles.of_dir(ours)):
        unpacked = _checkpoint(daemon / "ctrd-checkpoint2", b"core-A" * 100)
        theirs = _checkpoint(daemon / "ctrd-checkpoint3", b"core-B" * 100)
        (daemon / "ctrd-checkpoint4").mkdir()  # another restore, still unpacking
    assert not unpacked.exists()
    assert older.is_dir() and theirs.is_dir() and (daemon / "ctrd-checkpoint4").is_dir()
    assert ours.is_dir()


async def test_a_failed_restore_still_removes_its_copy(tmp_path: Path, daemon: Path) -> None:
    ours = _checkpoint(tmp_path / "ours", b"core-A" * 100)

    async def failed_restore() -> None:
        async with removing_leftovers(lambda: CriuFiles.of_dir(ours)):
            _checkpoint(daemon / "ctrd-checkpoint9", b"core-A" * 100)
            raise RuntimeError("ctr containers restore failed")

    with pytest.raises(RuntimeError):
        await failed_restore()
    assert not (daemon / "ctrd-checkpoint9").exists()
