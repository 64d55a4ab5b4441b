"""A local user against images kept on the host (issue case 1): a park to tmpfs, a staged or
kept image. Real jobs, real CRIU, a real unprivileged user.

Before the fix, nothing created the park directory in tmpfs at boot (any user could create it
first), and ``unpark`` restored whatever complete-looking image it found there, record or not:
a planted image made root write a cron.d-style file of the user's choosing. Now the park
directory must be root's and private, and a local image restores only as this host sealed it
(:mod:`spotguard.checkpoint.seal`)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from sec_helpers import Attacker

from spotguard.checkpoint import proctree, seal
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo, list_jobs, start_job
from spotguard.checkpoint.meta import META_NAME
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.errors import BadSignature, ParkError, UnsignedImage
from spotguard.image import ImageSettings
from spotguard.operations.checkpoint import checkpoint, kept_images_of
from spotguard.operations.kept import KeptImages, push_kept
from spotguard.operations.paths import ImageKept
from spotguard.park import core, record
from spotguard.park.settings import ParkSettings

pytestmark = pytest.mark.criu

LOOP = "import time\nwhile True:\n    print('tick', flush=True)\n    time.sleep(0.05)\n"


@pytest.fixture
async def setup(
    world: Path, shm_world: Path, criu_bin: str
) -> AsyncIterator[tuple[CheckpointSettings, ParkSettings, Engine]]:
    state = world / "state"
    cs = CheckpointSettings(state_dir=state, criu=criu_bin, criu_timeout=60)
    ps = ParkSettings(memory_dir=shm_world / "parked")
    yield cs, ps, Engine(Criu(criu_bin), settings=cs)
    for job in list_jobs(state):
        if proctree.alive(job.pid):
            proctree.signal_all([job.pid], signal.SIGKILL)


async def _job(cs: CheckpointSettings, name: str) -> JobInfo:
    job = await start_job([sys.executable, "-c", LOOP], name, state_dir=cs.state_dir)
    for _ in range(100):
        if (job.dir / "stdout").exists() and (job.dir / "stdout").read_text():
            break
        await asyncio.sleep(0.05)
    return job


async def _planted_image(cs: CheckpointSettings, engine: Engine, tmp: Path, cron: Path) -> Path:
    """A genuine CRIU image of a job named 'nb', its metadata rewritten to carry one more
    file: ``cron``, "held open for writing" (what a user who can write the image does)."""
    job = await _job(cs, "nb")
    res = await engine.freeze(job, DirectoryTarget(tmp / "genuine"), Mode.EXIT)
    d = res.images_dir
    meta = json.loads((d / META_NAME).read_text())
    line = b"* * * * * root /tmp/pwn\n"
    meta["files"].append(
        {"path": str(cron), "size": len(line), "mode": 0o644, "open_for_writing": True,
         "uid": 0, "gid": 0}
    )  # fmt: skip
    (d / META_NAME).write_text(json.dumps(meta))
    (d / "files" / str(cron).lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    (d / "files" / str(cron).lstrip("/")).write_bytes(line)
    (d / seal.SEAL_NAME).unlink(missing_ok=True)
    return d


async def test_an_image_planted_in_a_park_directory_another_user_made_is_never_restored(
    attacker: Attacker,
    setup: tuple[CheckpointSettings, ParkSettings, Engine],
    world: Path,
    shm_world: Path,
    tmp_path: Path,
) -> None:
    cs, ps, engine = setup
    cron = world / "cron.d" / "pwn"
    cron.parent.mkdir()
    genuine = await _planted_image(cs, engine, tmp_path, cron)
    # the user creates the park directory first (nothing made it at boot) and plants 'nb'
    os.mkdir(shm_world, 0o1777)
    os.chmod(shm_world, 0o1777)
    attacker.run("mkdir", "-m", "0777", str(ps.memory_dir))
    planted = ps.memory_dir / "nb"
    shutil.copytree(genuine, planted)
    for p in [planted, *planted.rglob("*")]:
        os.chown(p, attacker.uid, attacker.gid, follow_symlinks=False)
    with pytest.raises(ParkError, match="is not parked"):
        await core.unpark("nb", engine=engine, settings=cs, park_settings=ps)
    assert not cron.exists()
    # the same image in a park directory of root's, with no seal: not taken for a park
    attacker.run("rm", "-rf", str(ps.memory_dir))
    ps.memory_dir.mkdir(mode=0o700)
    shutil.copytree(genuine, ps.memory_dir / "nb")
    with pytest.raises(ParkError, match="is not parked"):
        await core.unpark("nb", engine=engine, settings=cs, park_settings=ps)
    assert not cron.exists()


async def test_a_parked_image_altered_after_its_park_is_refused_and_stays_parked(
    attacker: Attacker, setup: tuple[CheckpointSettings, ParkSettings, Engine]
) -> None:
    """A park to tmpfs is private (no other user reads the job's memory) and sealed: altered
    afterwards (here by root, standing for any way in), unpark refuses it before a byte of
    it is restored and the job stays parked."""
    cs, ps, engine = setup
    job = await _job(cs, "nb")
    rec = await core.park(job, to="tmpfs", engine=engine, settings=cs, park_settings=ps)
    d = Path(rec.location)
    pages = sorted(d / n for n in os.listdir(d) if n.startswith("pages-"))
    assert pages
    res = attacker.run("cat", str(pages[0]), check=False)
    assert res.returncode != 0  # 0700 root: the job's memory stays root's
    with pages[0].open("r+b") as f:
        f.seek(0)
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    with pytest.raises(BadSignature, match="altered after its seal"):
        await core.unpark("nb", engine=engine, settings=cs, park_settings=ps)
    assert record.load(cs.state_dir, "nb") is not None
    assert not proctree.alive(job.pid)
    # a file added to the image is refused the same way (nothing unrecorded restores)
    with pages[0].open("r+b") as f:
        f.write(first)
    (d / "core-9999.img").write_bytes(b"planted")
    with pytest.raises(BadSignature, match="unrecorded"):
        await core.unpark("nb", engine=engine, settings=cs, park_settings=ps)
    (d / "core-9999.img").unlink()
    done = await core.unpark("nb", engine=engine, settings=cs, park_settings=ps)
    assert proctree.alive(done.pid)


async def test_an_unsealed_image_directory_is_refused_by_restore(
    setup: tuple[CheckpointSettings, ParkSettings, Engine], tmp_path: Path
) -> None:
    """A local image without this host's seal (a copy from elsewhere, a planted one) is
    refused by the restore itself, before it is read."""
    cs, _ps, engine = setup
    job = await _job(cs, "nb")
    res = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
    (res.images_dir / seal.SEAL_NAME).unlink()
    with pytest.raises(UnsignedImage, match="has no seal"):
        await engine.restore(DirectorySource(res.images_dir), state_dir=cs.state_dir)


def _flip_staged_page(kept: KeptImages, job: str) -> Callable[[float], None]:
    """An ``on_frozen`` hook that alters the staged image between its seal and its push (what
    any way into the staging directory would do): the first byte of its first pages file."""

    def alter(_frozen_at: float) -> None:
        (image,) = kept.scan(job=job)
        pages = sorted(image.dir.glob("pages-*.img"))[0]
        data = bytearray(pages.read_bytes())
        data[0] ^= 0xFF
        pages.write_bytes(bytes(data))

    return alter


async def test_a_staged_image_altered_before_its_push_is_never_pushed_nor_signed(
    setup: tuple[CheckpointSettings, ParkSettings, Engine], shm_world: Path, tmp_path: Path
) -> None:
    """A staged checkpoint altered after its seal and before its push is refused before a
    byte of it reaches the store (a push signs what it uploads with the fleet's key). In
    ``resume`` mode the job runs on and the staged copy is dropped; in ``exit`` mode the job
    was stopped by the dump, so the image stays kept on this host, the failure is loud
    (``ImageKept`` names the seal's refusal) and the kept image is never pushed either."""
    cs0, _ps, engine = setup
    cs = CheckpointSettings(
        state_dir=cs0.state_dir, criu=cs0.criu, criu_timeout=60, shm_dir=shm_world / "staging"
    )
    store = tmp_path / "store"
    url = f"file://{store}"
    kept = kept_images_of(cs)
    image = ImageSettings()

    def run(job: JobInfo, mode: Mode) -> Any:
        return checkpoint(
            job, url, mode=mode, settings=cs, image_settings=image, engine=engine,
            stream="off", on_frozen=_flip_staged_page(kept, job.name),
        )  # fmt: skip

    job = await _job(cs, "nb")
    with pytest.raises(BadSignature, match="altered after its seal"):
        await run(job, Mode.RESUME)
    assert proctree.alive(job.pid) and not kept.scan(job="nb")
    assert not list(store.rglob("manifest.json"))
    with pytest.raises(ImageKept, match="altered after its seal") as caught:
        await run(job, Mode.EXIT)
    assert not proctree.alive(job.pid)
    (left,) = kept.scan(job="nb")
    assert left.dir == caught.value.kept.dir and "altered" in (left.error or "")
    with pytest.raises(BadSignature, match="altered after its seal"):
        await push_kept(left, url, images=kept, image_settings=image)
    assert not list(store.rglob("manifest.json"))
