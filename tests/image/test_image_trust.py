"""Authenticated images against a store attacker (issue 15), on real stores (a directory and
a moto S3 server): every attack on a manifest is refused by the reader, so by restore,
``images verify`` and ``images pull`` alike, with a typed error naming what failed and nothing
written into the destination."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from spotguard.contracts import WireError, chunk_key, manifest_key
from spotguard.errors import (
    BadSignature,
    ImageCorrupt,
    ImageError,
    ImageRollback,
    ImageUntrusted,
    UnsignedImage,
    UntrustedSigner,
)
from spotguard.image import (
    ImageReader,
    ImageSettings,
    gc,
    generate_key,
    generate_signing_key,
    latest_image,
    pull_image,
    push_dir,
    verify_image,
)
from spotguard.store import ImageStore, open_store

CHUNK = 256 << 10


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A real store: a directory, or a bucket on the moto server."""
    if request.param == "file":
        return (tmp_path / "store").as_uri()
    return str(request.getfixturevalue("s3_bucket")) + "/pfx"


@pytest.fixture
async def raw(store: str) -> AsyncIterator[ImageStore]:
    """The store as the attacker sees it: plain object reads and writes."""
    s = open_store(store)
    try:
        yield s
    finally:
        await s.aclose()


def keys(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A signing key file and its public key file."""
    private, public = generate_signing_key()
    (tmp_path / f"{name}.key").write_bytes(private)
    (tmp_path / f"{name}.pub").write_bytes(public)
    return tmp_path / f"{name}.key", tmp_path / f"{name}.pub"


def settings(**kw: Any) -> ImageSettings:
    return ImageSettings(chunk_size=CHUNK, workers=2, max_inflight_mb=8, **kw)


def job_dir(root: Path, seed: int) -> Path:
    root.mkdir(parents=True)
    (root / "pages-1.img").write_bytes(os.urandom(2 * CHUNK) + bytes([seed]) * CHUNK)
    (root / "core-1.img").write_bytes(os.urandom(999))
    return root


def image_id(url: str) -> str:
    return url.rsplit("/", 1)[-1]


async def read_manifest(raw: ImageStore, job: str, iid: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(await raw.get(manifest_key(job, iid)))
    return data


async def write_manifest(raw: ImageStore, job: str, iid: str, m: dict[str, Any]) -> None:
    await raw.put(manifest_key(job, iid), json.dumps(m).encode())


async def refused(
    url: str, s: ImageSettings, dest: Path, err: type[ImageError], match: str
) -> None:
    """Every reading path refuses the image the same way, and pull writes nothing."""
    with pytest.raises(err, match=match):
        await verify_image(url, settings=s)
    with pytest.raises(err, match=match):
        async with ImageReader(url, settings=s):
            pass
    await asyncio.to_thread(dest.mkdir, exist_ok=True)
    with pytest.raises(err, match=match):
        await pull_image(url, dest, settings=s)
    assert await asyncio.to_thread(os.listdir, dest) == []


async def test_signed_image_round_trip_and_sequence(store: str, tmp_path: Path) -> None:
    key, pub = keys(tmp_path, "fleet")
    agent = settings(signing_key_file=key)
    first = await push_dir(job_dir(tmp_path / "a", 1), store, "train", settings=agent)
    second = await push_dir(job_dir(tmp_path / "b", 2), store, "train", {"gpu": 1}, settings=agent)
    assert first.manifest.sequence == 1 and second.manifest.sequence == 2
    (sig,) = first.manifest.auth
    assert sig.alg == "ed25519" and len(base64.b64decode(sig.sig)) == 64
    host = settings(verify_key_file=pub)
    rep = await verify_image(second.image_url, settings=host)
    assert rep.ok and rep.authenticated.startswith("ed25519:")
    got = await pull_image(second.image_url, tmp_path / "d", settings=host)
    assert (got.dest / "core-1.img").read_bytes() == (tmp_path / "b" / "core-1.img").read_bytes()
    assert got.manifest.meta == {"gpu": 1}
    # a host without keys still reads signed images (it just cannot check them)
    assert (await verify_image(first.image_url, settings=settings())).authenticated == ""


async def test_unsigned_image_refused_where_a_key_is_trusted(store: str, tmp_path: Path) -> None:
    _, pub = keys(tmp_path, "fleet")
    planted = await push_dir(job_dir(tmp_path / "a", 1), store, "train", settings=settings())
    await refused(
        planted.image_url,
        settings(verify_key_file=pub),
        tmp_path / "d",
        UnsignedImage,
        "not signed",
    )


async def test_wrong_key_refused(store: str, tmp_path: Path) -> None:
    _, pub = keys(tmp_path, "fleet")
    evil, _ = keys(tmp_path, "evil")
    planted = await push_dir(
        job_dir(tmp_path / "a", 1), store, "train", settings=settings(signing_key_file=evil)
    )
    await refused(
        planted.image_url,
        settings(verify_key_file=pub),
        tmp_path / "d",
        UntrustedSigner,
        "does not trust",
    )


async def test_tampered_meta_and_truncated_signature_refused(
    store: str, raw: ImageStore, tmp_path: Path
) -> None:
    key, pub = keys(tmp_path, "fleet")
    res = await push_dir(
        job_dir(tmp_path / "a", 1),
        store,
        "train",
        {"gpu": {"model": "H100", "count": 8}},
        settings=settings(signing_key_file=key),
    )
    iid = image_id(res.image_url)
    host = settings(verify_key_file=pub)
    m = await read_manifest(raw, "train", iid)
    m["meta"]["gpu"]["count"] = 1  # the controller would pick a cheaper machine
    await write_manifest(raw, "train", iid, m)
    await refused(res.image_url, host, tmp_path / "d1", BadSignature, "does not match")

    m["meta"]["gpu"]["count"] = 8
    m["auth"][0]["sig"] = m["auth"][0]["sig"][:40]
    await write_manifest(raw, "train", iid, m)
    await refused(res.image_url, host, tmp_path / "d2", BadSignature, "signature")

    m["auth"] = []
    await write_manifest(raw, "train", iid, m)
    await refused(res.image_url, host, tmp_path / "d3", UnsignedImage, "not signed")


async def test_mixed_image_refused(store: str, raw: ImageStore, tmp_path: Path) -> None:
    """Metadata of one image with the page chunks of another: each half is genuine."""
    key, pub = keys(tmp_path, "fleet")
    agent = settings(signing_key_file=key)
    a = await push_dir(job_dir(tmp_path / "a", 1), store, "train", {"gpu": "a"}, settings=agent)
    b = await push_dir(job_dir(tmp_path / "b", 2), store, "train", {"gpu": "b"}, settings=agent)
    ma = await read_manifest(raw, "train", image_id(a.image_url))
    mb = await read_manifest(raw, "train", image_id(b.image_url))
    ma["files"] = mb["files"]
    await write_manifest(raw, "train", image_id(a.image_url), ma)
    await refused(
        a.image_url, settings(verify_key_file=pub), tmp_path / "d", BadSignature, "altered"
    )


async def test_swapped_chunk_refused(store: str, raw: ImageStore, tmp_path: Path) -> None:
    """A genuine manifest whose chunk object was replaced by another genuine chunk."""
    key, pub = keys(tmp_path, "fleet")
    res = await push_dir(
        job_dir(tmp_path / "a", 1), store, "train", settings=settings(signing_key_file=key)
    )
    pages = res.manifest.file("pages-1.img").chunks
    await raw.put(
        chunk_key("train", pages[0].digest), await raw.get(chunk_key("train", pages[1].digest))
    )
    host = settings(verify_key_file=pub)
    with pytest.raises(ImageCorrupt, match=pages[0].digest):
        await verify_image(res.image_url, settings=host)
    (tmp_path / "d").mkdir()
    with pytest.raises(ImageCorrupt, match=pages[0].digest):
        await pull_image(res.image_url, tmp_path / "d", settings=host)
    assert list((tmp_path / "d").iterdir()) == []


async def test_replayed_old_image_refused_and_latest_follows_sequence(
    store: str, raw: ImageStore, tmp_path: Path
) -> None:
    key, pub = keys(tmp_path, "fleet")
    agent = settings(signing_key_file=key)
    old = await push_dir(job_dir(tmp_path / "a", 1), store, "train", {"step": 1}, settings=agent)
    new = await push_dir(job_dir(tmp_path / "b", 2), store, "train", {"step": 2}, settings=agent)
    host = settings(verify_key_file=pub)
    # the old manifest republished under a newer id, as it is and with its id rewritten
    m = await read_manifest(raw, "train", image_id(old.image_url))
    await write_manifest(raw, "train", "29990101T000000000000Z-aaaaaa", m)
    m["image_id"] = "29990101T000000000000Z-bbbbbb"
    await write_manifest(raw, "train", m["image_id"], m)
    for iid, err in (
        ("29990101T000000000000Z-aaaaaa", ImageError),
        ("29990101T000000000000Z-bbbbbb", BadSignature),
    ):
        url = f"{store}/train/images/{iid}"
        with pytest.raises(err):
            await verify_image(url, settings=host)
    # `latest` is the newest *authenticated* sequence, not the greatest id
    assert await latest_image(store, "train", settings=host) == new.image_url
    async with ImageReader(f"{store}/train/images/latest", settings=host) as r:
        assert r.manifest.meta == {"step": 2}
    # the old image itself is genuine but older than the job's newest: refused unless asked
    await refused(old.image_url, host, tmp_path / "d", ImageRollback, "sequence 1")
    rolled = settings(verify_key_file=pub, allow_rollback=True)
    assert (await verify_image(old.image_url, settings=rolled)).ok


async def test_encryption_implies_authentication(
    store: str, raw: ImageStore, tmp_path: Path
) -> None:
    (tmp_path / "enc").write_text(generate_key().hex())
    enc = settings(encryption_key_file=tmp_path / "enc")
    # an attacker's plaintext image, where the victim holds an encryption key
    plain = await push_dir(job_dir(tmp_path / "p", 1), store, "train", settings=settings())
    await refused(plain.image_url, enc, tmp_path / "d0", UnsignedImage, "not encrypted")
    res = await push_dir(job_dir(tmp_path / "a", 1), store, "train", {"gpu": 8}, settings=enc)
    assert [a.alg for a in res.manifest.auth] == ["hmac-sha256"]
    assert (await verify_image(res.image_url, settings=enc)).ok
    m = await read_manifest(raw, "train", image_id(res.image_url))
    m["meta"]["gpu"] = 1
    await write_manifest(raw, "train", image_id(res.image_url), m)
    await refused(res.image_url, enc, tmp_path / "d1", BadSignature, "does not match")


async def test_a_refused_image_reaches_the_controller_as_the_images_fault_not_a_retry(
    tmp_path: Path,
) -> None:
    """Real refusals (an unsigned image; one signed by a key the host does not trust) are
    caught where image errors are caught, and their wire form tells the controller to pick an
    older image rather than retry this one (``retryable`` false, ``image_fault`` true)."""
    store = (tmp_path / "store").as_uri()
    _, trusted = keys(tmp_path, "fleet")
    other, _ = keys(tmp_path, "other")
    host = settings(verify_key_file=trusted)
    unsigned = await push_dir(job_dir(tmp_path / "a", 1), store, "train", settings=settings())
    foreign = await push_dir(
        job_dir(tmp_path / "b", 2), store, "train", settings=settings(signing_key_file=other)
    )
    for url, cls in ((unsigned.image_url, UnsignedImage), (foreign.image_url, UntrustedSigner)):
        with pytest.raises(ImageError) as caught:
            await verify_image(url, settings=host)
        assert isinstance(caught.value, cls) and isinstance(caught.value, ImageUntrusted)
        wire = WireError.of(caught.value)
        assert (wire.retryable, wire.image_fault) == (False, True), wire
        assert wire.message.startswith(f"{cls.__name__}: "), wire


async def test_gc_keeps_the_newest_authenticated_images_whatever_ids_an_attacker_writes(
    store: str, raw: ImageStore, tmp_path: Path
) -> None:
    """A bucket writer puts manifests under ids that sort after every genuine image (a forged
    one, and an old genuine one republished): gc on a host with the fleet's key still keeps
    the newest genuine image by sequence — never deletes it for a forgery — and leaves the
    unauthenticated manifests whole, naming them, for the operator to remove."""
    key, pub = keys(tmp_path, "fleet")
    agent = settings(signing_key_file=key)
    old = await push_dir(job_dir(tmp_path / "a", 1), store, "train", settings=agent)
    new = await push_dir(job_dir(tmp_path / "b", 2), store, "train", settings=agent)
    m = await read_manifest(raw, "train", image_id(new.image_url))
    m["image_id"] = "29990101T000000000000Z-forged"
    m["meta"] = {"evil": True}  # its signature no longer holds
    await write_manifest(raw, "train", m["image_id"], m)
    replay = await read_manifest(raw, "train", image_id(old.image_url))
    await write_manifest(raw, "train", "29990101T000000000000Z-replay", replay)
    host = settings(verify_key_file=pub)
    done = await gc(store, "train", 1, grace_s=0, settings=host)
    assert done.images_kept == [new.image_url]
    assert done.images_deleted == [old.image_url]
    assert sorted(done.images_unauthenticated) == [
        f"{store}/train/images/29990101T000000000000Z-forged",
        f"{store}/train/images/29990101T000000000000Z-replay",
    ]
    assert await latest_image(store, "train", settings=host) == new.image_url
    assert (await verify_image(new.image_url, settings=host)).ok  # every chunk still there
