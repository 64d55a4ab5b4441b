"""A local user against restore's carried files (issue case 2 and 7's ``open_for_writing``).

Restore runs as root and puts back the files the job held open for writing — some of them in
directories the job's user owns. The user swaps such a directory for a symlink while root
writes an earlier (large) file: the write must not land in the link's target."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from sec_helpers import Attacker

from spotguard.checkpoint import files
from spotguard.checkpoint.files import CapturedFile
from spotguard.errors import UnsafeCarriedFile

BIG = 256 << 20

#: as the attacker: wait until root starts rewriting big.log (its size leaves 1), then
#: swap the directory root writes next for a link to the root-only vault
SWAP = r"""
import os, sys, time
big, out, vault = sys.argv[1:4]
print("ready", flush=True)
deadline = time.time() + 60
while time.time() < deadline:
    try:
        if os.stat(big).st_size != 1:
            break
    except OSError:
        pass
os.rename(out, out + ".real")
os.symlink(vault, out)
print("swapped", flush=True)
"""


def _image(root: Path, entries: list[tuple[CapturedFile, bytes]]) -> Path:
    images = root / "img"
    for e, data in entries:
        p = images / files.FILES_DIR / e.path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return images


def test_a_directory_swapped_for_a_link_during_restore_cannot_redirect_a_write(
    attacker: Attacker, world: Path
) -> None:
    vault = world / "vault"  # root-only, holding a file root cares about
    vault.mkdir(mode=0o700)
    (vault / "log").write_text("root's own file\n")
    (vault / "log").chmod(0o600)
    pub = world / "pub"  # where the job writes a big log (readable: the attacker watches it)
    pub.mkdir(mode=0o755)
    (pub / "big.log").write_bytes(b"x")
    home = world / "home"  # the attacker's own directory, with the job's other output
    home.mkdir()
    os.chown(home, attacker.uid, attacker.gid)
    attacker.run("mkdir", str(home / "out"))
    jobdir = world / "state" / "jobs" / "j1"
    jobdir.mkdir(parents=True)
    big = CapturedFile(str(pub / "big.log"), BIG, 0o644, True, 0, 0)
    log = CapturedFile(str(home / "out" / "log"), 5, 0o644, True, attacker.uid, attacker.gid)
    images = _image(world, [(big, b"\0" * BIG), (log, b"hello")])
    swapper = attacker.popen(SWAP, str(pub / "big.log"), str(home / "out"), str(vault))
    try:
        assert swapper.stdout is not None and swapper.stdout.readline().strip() == "ready"
        with pytest.raises(UnsafeCarriedFile, match="symlink"):
            files.put_back(
                [big, log], images, image_job_dir=jobdir, job_dir=jobdir, authenticated=True
            )
        assert swapper.wait(60) == 0 and "swapped" in swapper.stdout.read()
    finally:
        if swapper.poll() is None:
            swapper.kill()
    assert (vault / "log").read_text() == "root's own file\n"
    st = (vault / "log").stat()
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
    assert sorted(p.name for p in vault.iterdir()) == ["log"]


def test_open_for_writing_from_an_unauthenticated_image_writes_nothing_outside_the_job(
    attacker: Attacker, world: Path
) -> None:
    """On a host without keys an image's ``open_for_writing`` flag is the image's word only:
    it cannot make root write a file outside the job's directory (cron.d-style)."""
    crond = world / "cron.d"
    crond.mkdir(mode=0o755)
    jobdir = world / "state" / "jobs" / "j1"
    jobdir.mkdir(parents=True)
    line = b"* * * * * root id\n"
    evil = CapturedFile(str(crond / "pwn"), len(line), 0o644, True, attacker.uid, attacker.gid)
    images = _image(world, [(evil, line)])
    with pytest.raises(UnsafeCarriedFile, match="not authenticated"):
        files.put_back([evil], images, image_job_dir=jobdir, job_dir=jobdir)
    assert list(crond.iterdir()) == []
