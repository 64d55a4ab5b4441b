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
from spotguard.image.manifest import Manifest
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
        with pytest.raises(ImageError, match="200000 JSON arrays"):
            async with ImageReader(f"{url}/j1/images/29990101T000000000000Z", settings=settings):
                pass
        # within the count limits, nesting still has its own bound
        deep = b'{"format": "spotguard-image/2", "meta": ' + b"[" * 100 + b"]" * 100 + b"}"
        with pytest.raises(ImageError, match="nests 101"):
            Manifest.parse(deep, "deep")

    asyncio.run(go())
    res = _sg("images", "verify", f"{url}/j1/images/29990101T000000000000Z")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0 and "JSON arrays" in res.stderr


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


JUNK = r"""
import os, sys
images, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
head, tail = b'{"format": "spotguard-image/2", "job": "j1", "meta": [', b"{}]}"
body = b"{}," * ((size - len(head) - len(tail)) // 3)
for i in range(count):
    d = os.path.join(images, "29990101T0000000000%02dZ" % i)
    os.makedirs(d)
    with open(os.path.join(d, "manifest.json"), "wb") as f:
        f.write(head + body + tail)
d = os.path.join(images, "29990101T000000000099Z")
os.makedirs(d)
with open(os.path.join(d, "manifest.json"), "wb") as f:
    f.truncate(1 << 30)
"""

CHECKPOINT = r"""
import asyncio, resource, sys, time
from spotguard.image import ImageReader, ImageSettings, push_dir
src, url = sys.argv[1:3]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.monotonic()
async def go():
    settings = ImageSettings()
    push = await push_dir(src, url, "j1", settings=settings)
    async with ImageReader(push.image_url, settings=settings) as r:
        return r.manifest.sequence
seq = asyncio.run(go())
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(seq, grown, round(time.monotonic() - t0, 2))
"""

JUNK_MANIFESTS = 16
JUNK_BYTES = 15 << 20  # each just under the manifest cap, as many JSON objects as bytes allow


def test_sixteen_large_junk_manifests_leave_the_next_checkpoint_whole_in_bounded_memory(
    attacker: Attacker, world: Path
) -> None:
    """A bucket writer plants 16 manifests of 15 MiB each that are valid JSON made of five
    million empty objects (parsed, each would take ~400 MB), and one of 1 GiB: the job's next
    checkpoint (its writer reads every manifest of the job for the sequence) still succeeds,
    its process grows by less than 150 MiB at its peak, and ``images verify`` of a junk
    manifest is a one-line error in bounded memory."""
    store = world / "store"
    (store / "j1" / "images").mkdir(parents=True)
    _give(store / "j1", attacker)
    attacker.python(JUNK, str(store / "j1" / "images"), str(JUNK_MANIFESTS), str(JUNK_BYTES))
    url = f"file://{store}"
    res = subprocess.run(
        [sys.executable, "-c", CHECKPOINT, str(_image_dir(world)), url],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    seq, grown_kib, secs = res.stdout.split()
    assert int(seq) == 1
    assert int(grown_kib) < 150 << 10, f"peak RSS grew {int(grown_kib) >> 10} MiB in {secs} s"
    junk = f"{url}/j1/images/29990101T000000000000Z"
    res = subprocess.run(
        [sys.executable, "-c", RSS, sys.executable, "-m", "spotguard", "images", "verify", junk],
        capture_output=True,
        text=True,
        timeout=300,
    )
    code, rss_kib = (int(x) for x in res.stdout.split()[:2])
    assert code != 0 and "Traceback" not in res.stdout and "manifest of" in res.stdout
    assert rss_kib < 250 << 10, f"images verify: peak RSS {rss_kib >> 10} MiB"
