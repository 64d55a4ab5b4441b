"""A writer of the bucket against the readers (issue case 5): anything read from a store is
bounded before it is parsed, and a bad image never fails later checkpoints of the job.

The store is a ``file://`` directory whose job prefix belongs to a real unprivileged user
(``attacker``): what it writes there is what anyone holding write access to the bucket could
write."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sec_helpers import Attacker

from spotguard.errors import ImageError
from spotguard.image import ImageReader, ImageSettings, push_dir
from spotguard.image.history import next_sequence
from spotguard.image.keys import ImageKeys
from spotguard.store import open_store

NESTED = r"""
import os, sys
path = sys.argv[1]
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "w") as f:
    f.write('{"format": "spotguard-image/2", "meta": ' + "[" * 200000 + "]" * 200000 + "}")
"""

RSS = r"""
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True)
print(r.stderr, end="")
"""


def _image_dir(root: Path) -> Path:
    d = root / "src"
    d.mkdir()
    (d / "pages-1.img").write_bytes(os.urandom(256 << 10))
    return d


def _give(path: Path, attacker: Attacker) -> None:
    for p in [path, *path.rglob("*")]:
        os.chown(p, attacker.uid, attacker.gid, follow_symlinks=False)


def _sg(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotguard", *args], capture_output=True, text=True, timeout=120
    )


def test_a_200000_level_manifest_is_a_typed_error_and_later_checkpoints_still_work(
    attacker: Attacker, world: Path
) -> None:
    store = world / "store"
    (store / "j1").mkdir(parents=True)
    _give(store / "j1", attacker)
    bad = store / "j1" / "images" / "29990101T000000000000Z" / "manifest.json"
    attacker.python(NESTED, str(bad))
    assert bad.stat().st_size > 400_000
    settings = ImageSettings()
    url = f"file://{store}"

    async def go() -> None:
        st = open_store(url)
        try:
            assert await next_sequence(st, "j1", ImageKeys.from_settings(settings)) == 1
        finally:
            await st.aclose()
        # a later checkpoint of the job: its writer reads every manifest of the job
        push = await push_dir(_image_dir(world), url, "j1", settings=settings)
        async with ImageReader(push.image_url, settings=settings) as r:
            assert r.manifest.sequence == 1
        with pytest.raises(ImageError, match="nests"):
            async with ImageReader(f"{url}/j1/images/29990101T000000000000Z", settings=settings):
                pass

    asyncio.run(go())
    res = _sg("images", "verify", f"{url}/j1/images/29990101T000000000000Z")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0 and "nests" in res.stderr


def test_a_1_gib_object_at_a_chunk_address_is_never_read_whole(
    attacker: Attacker, world: Path
) -> None:
    store = world / "store"
    store.mkdir()
    url = f"file://{store}"
    push = asyncio.run(push_dir(_image_dir(world), url, "j1", settings=ImageSettings()))
    manifest = json.loads(next((store / "j1" / "images").glob("*/manifest.json")).read_text())
    addr = manifest["files"][0]["chunks"][0]["digest"]
    chunk = store / "j1" / "chunks" / addr[:2] / addr
    _give(store / "j1", attacker)
    attacker.run("truncate", "-s", "1G", str(chunk))
    for argv in (
        ["images", "verify", push.image_url],
        ["images", "pull", push.image_url, str(world / "pulled")],
    ):
        res = subprocess.run(
            [sys.executable, "-c", RSS, sys.executable, "-m", "spotguard", *argv],
            capture_output=True,
            text=True,
            timeout=300,
        )
        code, rss_kib = (int(x) for x in res.stdout.split()[:2])
        assert code != 0, argv
        assert rss_kib < 400 * 1024, f"{argv}: peak RSS {rss_kib >> 10} MiB"
        assert "Traceback" not in res.stdout and "corrupt" in res.stdout, res.stdout


FORGE = r"""
import json, os, sys
src, dest = sys.argv[1:3]
m = json.load(open(src))
m["image_id"] = os.path.basename(os.path.dirname(dest))
m["sequence"] = 99
m["auth"] = []
os.makedirs(os.path.dirname(dest))
json.dump(m, open(dest, "w"))
"""


def test_gc_without_keys_deletes_nothing_it_cannot_authenticate(
    attacker: Attacker, world: Path
) -> None:
    """On a host without keys, a manifest a bucket writer forged (newest id and sequence)
    would pass for the newest image and gc would delete the genuine one: gc refuses in one
    line and deletes nothing (``--trust-store`` is the operator saying the store is theirs)."""
    store = world / "store"
    store.mkdir()
    url = f"file://{store}"
    push = asyncio.run(push_dir(_image_dir(world), url, "j1", settings=ImageSettings()))
    genuine = next((store / "j1" / "images").glob("*/manifest.json"))
    _give(store / "j1", attacker)
    forged = store / "j1" / "images" / "29990101T000000000000Z" / "manifest.json"
    attacker.python(FORGE, str(genuine), str(forged))
    res = _sg("images", "gc", url, "--keep", "1")
    assert res.returncode == 2 and "nothing deleted" in res.stderr
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    assert genuine.exists() and forged.exists()
    res = _sg("images", "verify", push.image_url)
    assert res.returncode == 0, res.stderr
