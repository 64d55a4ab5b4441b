"""Restore writes only what a job owns (issue 15): carried files go into the job's directory or
back to paths the job held open for writing at the dump, never with setuid/setgid bits, never
through ``..`` or a symlink; anything else refuses the whole image before a byte is written.

The last test runs the attack end to end: a real job frozen by real CRIU into a signed image
on a file store, its carried-file list rewritten by a store attacker, restore refused."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import sys
from pathlib import Path

import pytest

from spotguard.checkpoint import files
from spotguard.checkpoint.files import CapturedFile
from spotguard.checkpoint.meta import META_NAME, ImageMeta
from spotguard.errors import BadSignature, UnsafeCarriedFile, UnsignedImage


def image_with(tmp_path: Path, entries: list[CapturedFile]) -> Path:
    """An images directory holding ``entries`` under files/ (as capture lays them out)."""
    images = tmp_path / "img"
    for e in entries:
        p = images / files.FILES_DIR / e.path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * e.size)
    return images


def everything(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")} if root.exists() else set()


@pytest.fixture
def jobdir(tmp_path: Path) -> Path:
    d = tmp_path / "state" / "jobs" / "train"
    d.mkdir(parents=True)
    return d


def test_job_files_and_open_files_are_put_back(tmp_path: Path, jobdir: Path) -> None:
    out = tmp_path / "work" / "out.log"
    entries = [
        CapturedFile(str(jobdir / "stdout"), 5, 0o644),
        CapturedFile(str(jobdir / "sub" / "state"), 3, 0o600),
        CapturedFile(str(out), 7, 0o640, open_for_writing=True),
    ]
    images = image_with(tmp_path, entries)
    # open_for_writing is the image's claim: only an authenticated image may use it
    with pytest.raises(UnsafeCarriedFile, match="not authenticated"):
        files.put_back(entries, images, image_job_dir=jobdir, job_dir=jobdir)
    assert not out.exists()
    written = files.put_back(
        entries, images, image_job_dir=jobdir, job_dir=jobdir, authenticated=True
    )
    assert sorted(written) == sorted(Path(e.path) for e in entries)
    assert (jobdir / "stdout").read_bytes() == b"xxxxx"
    assert stat.S_IMODE((jobdir / "sub" / "state").stat().st_mode) == 0o600
    assert stat.S_IMODE(out.stat().st_mode) == 0o640


@pytest.mark.parametrize(
    ("path", "mode", "writing", "why"),
    [
        ("/{tmp}/elsewhere/pwned", 0o6755, False, "setuid"),
        ("/{tmp}/elsewhere/pwned", 0o644, False, "not a file the job held open for writing"),
        ("../pwned-rel", 0o644, True, "absolute"),
        ("{job}/../../../pwned", 0o644, False, "normalized"),
        ("{job}/stdout", 0o4755, False, "setuid"),
        ("{job}/stdout", 0o2644, False, "setgid"),
        ("{job}/stdout", 0o20644, False, "file-type"),
        ("{tmp}/out.log", 0o6755, True, "setuid"),
        ("{job}/a\0b", 0o644, False, "NUL"),
    ],
)
def test_crafted_entries_are_refused_and_nothing_is_written(
    tmp_path: Path, jobdir: Path, path: str, mode: int, writing: bool, why: str
) -> None:
    good = CapturedFile(str(jobdir / "stdout"), 5, 0o644)
    bad = CapturedFile(path.format(tmp=tmp_path, job=jobdir).replace("//", "/"), 3, mode, writing)
    images = tmp_path / "img"
    (images / files.FILES_DIR / "x").mkdir(parents=True)
    (images / files.FILES_DIR / good.path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    (images / files.FILES_DIR / good.path.lstrip("/")).write_bytes(b"xxxxx")
    before = everything(tmp_path)
    cwd = os.getcwd()
    os.chdir(tmp_path / "img")
    try:
        with pytest.raises(UnsafeCarriedFile, match=why):
            files.put_back([good, bad], images, image_job_dir=jobdir, job_dir=jobdir)
    finally:
        os.chdir(cwd)
    assert everything(tmp_path) == before  # not even the good file: refused as a whole


@pytest.mark.parametrize("where", ["/etc", "/", "{tmp}/state/jobs/other", "relative/jobs/train"])
def test_job_directory_cannot_be_pointed_anywhere(tmp_path: Path, jobdir: Path, where: str) -> None:
    pointed = Path(where.format(tmp=tmp_path))
    entries = [CapturedFile(str(pointed / "stdout"), 2, 0o644)]
    images = image_with(tmp_path, entries) if pointed.is_absolute() else tmp_path / "img"
    before = everything(tmp_path)
    with pytest.raises(UnsafeCarriedFile, match="job directory"):
        files.put_back(entries, images, image_job_dir=pointed, job_dir=jobdir)
    assert everything(tmp_path) == before


def test_symlink_inside_the_job_directory_is_not_followed(tmp_path: Path, jobdir: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (jobdir / "logs").symlink_to(outside, target_is_directory=True)
    entries = [CapturedFile(str(jobdir / "logs" / "authorized_keys"), 4, 0o600)]
    images = image_with(tmp_path, entries)
    with pytest.raises(UnsafeCarriedFile, match="symlink"):
        files.put_back(entries, images, image_job_dir=jobdir, job_dir=jobdir)
    assert list(outside.iterdir()) == []


def test_capture_records_open_files_and_strips_special_bits(tmp_path: Path, jobdir: Path) -> None:
    (jobdir / "stdout").write_text("hi\n")
    (jobdir / "tool").write_text("#!/bin/sh\n")
    os.chmod(jobdir / "tool", 0o4755)
    log = tmp_path / "work.log"
    log.write_text("w\n")
    paths = files.candidates(jobdir, [log])
    got = {Path(c.path).name: c for c in files.capture(paths, tmp_path / "img", 1 << 20)}
    assert got["tool"].mode == 0o755 and not got["tool"].open_for_writing
    assert got["work.log"].open_for_writing and not got["stdout"].open_for_writing
    assert got["work.log"].uid == os.getuid()
    back = ImageMeta.from_json(
        json.loads(json.dumps({**_meta_json(), "files": [c.to_json() for c in got.values()]}))
    )
    assert {c.path for c in back.files} == {c.path for c in got.values()}


def _meta_json() -> dict[str, object]:
    return {
        "job": {"name": "train", "pid": 1, "dir": "/x/jobs/train"},
        "mode": "exit",
        "criu_version": "4.2",
        "host": {"kernel": "6.18", "arch": "x86_64", "memory_total": 1},
        "gpu": None,
    }


# --- end to end: real CRIU, a signed image in a file store, a store attacker -----------------


async def test_restore_of_a_rewritten_image_is_refused_before_anything_is_written(
    criu_bin: str, tmp_path: Path
) -> None:

    from spotguard.checkpoint.criu import Criu
    from spotguard.checkpoint.engine import Engine, Mode
    from spotguard.checkpoint.jobs import start_job
    from spotguard.checkpoint.settings import CheckpointSettings
    from spotguard.checkpoint.staging import DirectoryTarget
    from spotguard.contracts import manifest_key
    from spotguard.image import ImageSettings, generate_signing_key, push_dir
    from spotguard.operations import restore

    private, public = generate_signing_key()
    (tmp_path / "k").write_bytes(private)
    (tmp_path / "k.pub").write_bytes(public)
    agent = ImageSettings(signing_key_file=tmp_path / "k", workers=2)
    host = ImageSettings(verify_key_file=tmp_path / "k.pub", workers=2)
    state = tmp_path / "state"
    cs = CheckpointSettings(state_dir=state, criu=criu_bin, shm_dir=tmp_path / "shm")
    engine = Engine(Criu(criu_bin), settings=cs)
    job = await start_job(
        [sys.executable, "-c", "import time\nwhile True: print('x', flush=True); time.sleep(0.05)"],
        "victim",
        state_dir=state,
    )
    try:
        res = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.pid, signal.SIGKILL)
    store = (tmp_path / "store").as_uri()
    signed = await push_dir(res.images_dir, store, "victim", settings=agent)
    # the attacker adds a setuid file at an absolute path to the carried files and pushes the
    # image unsigned (they hold no key) ...
    meta = json.loads((res.images_dir / META_NAME).read_text())
    pwned = tmp_path / "pwned"
    meta["files"].append({"path": str(pwned), "size": 2, "mode": 0o6755})
    (res.images_dir / META_NAME).write_text(json.dumps(meta))
    (res.images_dir / "files" / str(pwned).lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    (res.images_dir / "files" / str(pwned).lstrip("/")).write_bytes(b"#!")
    unsigned = await push_dir(res.images_dir, store, "victim", settings=ImageSettings(workers=2))
    shutil.rmtree(job.dir)
    before = everything(tmp_path) - everything(tmp_path / "store")

    with pytest.raises(UnsignedImage):
        await restore(unsigned.image_url, settings=cs, engine=engine, image_settings=host)
    # where no key is configured, the signature cannot help: the path rules still do
    with pytest.raises(UnsafeCarriedFile, match="setuid"):
        await restore(
            unsigned.image_url, settings=cs, engine=engine, image_settings=ImageSettings(workers=2)
        )
    assert not pwned.exists() and not job.dir.exists()
    # ... and grafts the rewritten chunks into the genuine signed manifest
    mkey = tmp_path / "store" / manifest_key("victim", signed.manifest.image_id)
    m = json.loads(mkey.read_bytes())
    m["files"] = json.loads(
        (tmp_path / "store" / manifest_key("victim", unsigned.manifest.image_id)).read_bytes()
    )["files"]
    mkey.write_text(json.dumps(m))
    with pytest.raises(BadSignature):
        await restore(signed.image_url, settings=cs, engine=engine, image_settings=host)
    after = everything(tmp_path) - everything(tmp_path / "store")
    assert not pwned.exists() and not job.dir.exists()
    assert {p for p in after - before if "shm" not in p.parts} == set()
