"""Damaged images, as an operator meets them: a real job (``spotguard run``) checkpointed with
real CRIU into a ``file://`` store (``spotguard checkpoint``, streamed and staged), then one
chunk corrupted, deleted, truncated, two chunks swapped, or the manifest copied under another
job (pointing at chunks that job does not have). ``spotguard images verify``, ``images pull``
and ``spotguard restore`` each refuse with one line naming the chunk, exit non-zero, and write
nothing: no pulled file, no byte of the job's directory, no process.

And the manifest commit at the image level: a store that refuses (full) or stops answering
when the manifest is written leaves no new image, and the previous one stays the newest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sgtest import flip_a_byte, sg_env
from spotguard.contracts import chunk_key
from spotguard.errors import StoreError
from spotguard.image import ImageSettings, latest_image, list_images, push_dir
from spotguard.statedir import StateDir

pytestmark = pytest.mark.timeout(120)

DEMO = [sys.executable, "-m", "spotguard.demo.job", "--gpu", "no", "--mb", "4"]


@dataclass
class Checkpointed:
    """One real job, checkpointed (exit mode) into a file store; the pristine copies."""

    state: Path
    store: Path
    job: str
    image_id: str
    env: dict[str, str]


def _checkpoint(root: Path, criu: str, job: str, stream: str) -> Checkpointed:
    state, store = root / "state", root / "store"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env.update(SPOTGUARD_STATE_DIR=str(state), SPOTGUARD_CRIU=str(criu))
    env.update(SPOTGUARD_SHM_DIR=str(root / "shm"))
    r = sg_env("run", "--json", "--name", job, "--", *DEMO, "--steps", "100000",
           "--step-seconds", "0.02", env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = StateDir(state).job(job) / "stdout"
    deadline = time.monotonic() + 30
    while not (out.exists() and len(out.read_text().splitlines()) > 3):
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.05)
    r = sg_env("checkpoint", job, "--to", store.as_uri(), "--stream", stream, "--json", env=env)
    assert r.returncode == 0, r.stderr
    image = json.loads(r.stdout)
    url = str(image.get("image_url") or image.get("image"))
    return Checkpointed(state, store, job, url.rstrip("/").rsplit("/", 1)[1], env)


@pytest.fixture(scope="module")
def images(criu_bin: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpointed]:
    """A streamed and a staged image of a real job, made once for the module."""
    root = tmp_path_factory.mktemp("images")
    return {
        "streamed": _checkpoint(root / "streamed", criu_bin, "dmg-streamed", "on"),
        "staged": _checkpoint(root / "staged", criu_bin, "dmg-staged", "off"),
    }


# --- damage ----------------------------------------------------------------------------------


def _manifest(store: Path, job: str, image_id: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (store / job / "images" / image_id / "manifest.json").read_text()
    )
    return data


def _digests(m: dict[str, Any]) -> list[str]:
    """Chunk digests, the largest file's first (CRIU's pages)."""
    files = sorted(m["files"], key=lambda f: -int(f["size"]))
    out: list[str] = []
    for f in files:
        for c in f["chunks"]:
            if c["digest"] not in out:
                out.append(c["digest"])
    return out


def _corrupt(store: Path, job: str, m: dict[str, Any]) -> tuple[str, str]:
    d = _digests(m)[0]
    flip_a_byte(store / chunk_key(job, d))
    return job, d


def _missing(store: Path, job: str, m: dict[str, Any]) -> tuple[str, str]:
    d = _digests(m)[0]
    (store / chunk_key(job, d)).unlink()
    return job, d


def _truncated(store: Path, job: str, m: dict[str, Any]) -> tuple[str, str]:
    d = _digests(m)[0]
    p = store / chunk_key(job, d)
    p.write_bytes(p.read_bytes()[: max(1, p.stat().st_size // 2)])
    return job, d


def _swapped(store: Path, job: str, m: dict[str, Any]) -> tuple[str, str]:
    a, b = _digests(m)[:2]
    pa, pb = store / chunk_key(job, a), store / chunk_key(job, b)
    da, db = pa.read_bytes(), pb.read_bytes()
    pa.write_bytes(db)
    pb.write_bytes(da)
    return job, ""  # either chunk may be named first: both are wrong


def _foreign(store: Path, job: str, m: dict[str, Any]) -> tuple[str, str]:
    """The manifest copied under another job: it points at chunks that job does not have."""
    other = f"{job}-other"
    src = next((store / job / "images").iterdir())
    dest = store / other / "images" / src.name
    dest.mkdir(parents=True)
    body = json.loads((src / "manifest.json").read_text())
    body["job"] = other
    (dest / "manifest.json").write_text(json.dumps(body))
    return other, ""


DAMAGE: dict[str, Callable[[Path, str, dict[str, Any]], tuple[str, str]]] = {
    "corrupt": _corrupt,
    "missing": _missing,
    "truncated": _truncated,
    "swapped": _swapped,
    "foreign": _foreign,
}


@dataclass
class Damaged:
    url: str
    chunk: str  # the chunk the error must name ("" when any of the damaged ones will do)
    base: Checkpointed
    store: Path


@pytest.fixture
def damage(images: dict[str, Checkpointed], tmp_path: Path) -> Callable[[str, str], Damaged]:
    def make(kind: str, what: str) -> Damaged:
        base = images[kind]
        store = tmp_path / "store"
        shutil.copytree(base.store, store)
        m = _manifest(store, base.job, base.image_id)
        job, chunk = DAMAGE[what](store, base.job, m)
        return Damaged(f"{store.as_uri()}/{job}/images/{base.image_id}", chunk, base, store)

    return make


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def _refused(r: subprocess.CompletedProcess[str], d: Damaged) -> str:
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("spotguard: error:"), r.stderr
    assert "corrupt" in last or "missing" in last, last
    if d.chunk:
        assert d.chunk in last, last
    return last


# --- the cases -------------------------------------------------------------------------------


@pytest.mark.parametrize("what", sorted(DAMAGE))
def test_images_verify_refuses_naming_the_chunk(
    damage: Callable[[str, str], Damaged], what: str
) -> None:
    d = damage("streamed", what)
    _refused(sg_env("images", "verify", d.url, env=d.base.env), d)


@pytest.mark.parametrize("what", sorted(DAMAGE))
def test_images_pull_refuses_and_writes_nothing(
    damage: Callable[[str, str], Damaged], what: str, tmp_path: Path
) -> None:
    d = damage("staged", what)
    dest = tmp_path / "pulled"
    _refused(sg_env("images", "pull", d.url, str(dest), env=d.base.env), d)
    assert not dest.exists() or not any(dest.iterdir()), sorted(dest.rglob("*"))


@pytest.mark.parametrize("kind", ["streamed", "staged"])
@pytest.mark.parametrize("what", sorted(DAMAGE))
def test_restore_refuses_before_writing_anything_of_the_job(
    damage: Callable[[str, str], Damaged], what: str, kind: str
) -> None:
    d = damage(kind, what)
    jobdir = StateDir(d.base.state).job(d.base.job)
    before = _snapshot(d.base.state)
    info = json.loads((jobdir / "job.json").read_text())
    r = sg_env("restore", d.url, env=d.base.env)
    _refused(r, d)
    assert _snapshot(d.base.state) == before, "restore wrote into the state dir"
    assert json.loads((jobdir / "job.json").read_text()) == info
    pid = int(info["pid"])
    assert not Path(f"/proc/{pid}").exists() or _zombie(pid), "a process of the job runs"


def _zombie(pid: int) -> bool:
    try:
        return " Z " in Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True


# --- the manifest commit ---------------------------------------------------------------------

S = ImageSettings(chunk_size=256 << 10, workers=1, max_inflight_mb=2, retries=2, store_timeout=0.5)


def _dir(root: Path, seed: int) -> Path:
    root.mkdir(parents=True)
    (root / "pages-1.img").write_bytes(os.urandom(600_000))
    (root / "core-1.img").write_bytes(str(seed).encode() * 100)
    return root


@pytest.mark.parametrize("action", ["507", "too-large", "hang", "503", "drop"])
async def test_failed_manifest_commit_leaves_no_image(
    fault_proxy: Any, s3_bucket: str, tmp_path: Path, action: str
) -> None:
    good = await push_dir(_dir(tmp_path / "a", 1), s3_bucket, "job", settings=S)
    fault_proxy.add("PUT", "manifest.json", action, times=1000)
    with pytest.raises(StoreError):
        await push_dir(_dir(tmp_path / "b", 2), s3_bucket, "job", settings=S)
    fault_proxy.faults.clear()
    listed = await list_images(s3_bucket, "job", settings=S)
    assert [i.image_id for i in listed if i.complete] == [good.manifest.image_id]
    assert await latest_image(s3_bucket, "job", settings=S) == good.image_url
