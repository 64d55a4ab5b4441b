"""Damaged and hostile images, many ways (a deterministic fuzz): every reading path — the
reader (``iter_file`` and ``iter_file_owned``), ``verify_image`` and ``pull_image`` — either
hands out exactly the verified bytes the manifest names, or fails quickly with a typed,
non-retryable :class:`~spotguard.errors.ImageError`; a failed pull leaves its destination
empty, and no path leaves a file anywhere (the store included).

A small real image (a raw-frame chunk, an all-zero chunk, a compressed chunk shared by two
files, a nested file) is written with :class:`ImageWriter` to a ``file://`` store, then its
manifest and chunk objects are mutated: truncation, wrong types in every field, hostile file
names, sizes and chunk references that do not add up, chunk objects truncated, extended,
bit-flipped or replaced (another frame, zip bombs), and another image's manifest. Unsigned,
and signed with a host that holds the verify key.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zstandard

from spotguard.errors import (
    BadSignature,
    ImageCorrupt,
    ImageError,
    SpotguardError,
)
from spotguard.image import (
    ImageReader,
    ImageSettings,
    ImageWriter,
    generate_signing_key,
    pull_image,
    verify_image,
)
from spotguard.names import chunk_key, manifest_key

CHUNK = 512 << 10  # large enough for random bytes to be stored as a raw frame
SEED = 0x5EED
JOB = "fuzz"
PATH_SECONDS = 5.0  # one reading path of one damaged image (they take milliseconds)
BAD_VALUES: list[Any] = [None, -1, 0, 2**70, -(2**70), 1.5, "x", "", {"a": 1}, [], [1], True]


@dataclass
class Img:
    """A written image and what a fuzz case needs of it."""

    root: Path
    image_id: str
    host: ImageSettings  # what the reading host holds
    written: bytes  # the manifest as written
    plain: dict[str, bytes]  # every chunk's plaintext by address

    @property
    def store_dir(self) -> Path:
        return self.root / "store"

    @property
    def url(self) -> str:
        return f"{self.store_dir.as_uri()}/{JOB}/images/{self.image_id}"

    @property
    def manifest_path(self) -> Path:
        return self.store_dir / manifest_key(JOB, self.image_id)

    def chunk_path(self, digest: str) -> Path:
        return self.store_dir / chunk_key(JOB, digest)

    def raw(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.written)
        return data


def image_files(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    pattern = bytes(rng.randrange(4) for _ in range(100_000))  # compresses
    return {
        "pages-1.img": rng.randbytes(CHUNK) + bytes(CHUNK) + pattern,  # raw, zero, zstd
        "sub/core-1.img": rng.randbytes(400),
        "again.img": pattern,  # the same chunk as the last of pages-1.img
    }


async def write(root: Path, image_id: str, seed: int, ws: ImageSettings) -> dict[str, bytes]:
    """Write an image; its chunks' plaintexts by address."""
    files = image_files(seed)
    async with ImageWriter((root / "store").as_uri(), JOB, image_id, settings=ws) as w:
        for name, data in files.items():
            sink = w.file(name, 0o640)
            await sink.write(data)
            await sink.close()
        m = await w.commit({"gpu": {"model": "H100", "count": 8}, "steps": [1, 2.5, "x"]})
    plain = {}
    for f in m.files:
        off = 0
        for c in f.chunks:
            plain[c.digest] = files[f.name][off : off + c.size]
            off += c.size
    return plain


def settings(**kw: Any) -> ImageSettings:
    return ImageSettings(chunk_size=CHUNK, workers=2, max_inflight_mb=4, **kw)


async def build(root: Path, signed: bool) -> Img:
    ws = host = settings()
    if signed:
        private, public = generate_signing_key()
        (root / "k.key").write_bytes(private)
        (root / "k.pub").write_bytes(public)
        ws, host = (
            settings(signing_key_file=root / "k.key"),
            settings(verify_key_file=root / "k.pub"),
        )
    plain = await write(root, "img-a", SEED, ws)
    img = Img(root, "img-a", host, b"", plain)
    img.written = img.manifest_path.read_bytes()
    if signed:
        assert img.raw()["auth"], "the signed image carries no signature"
    return img


@pytest.fixture(params=["unsigned", "signed"])
async def img(request: pytest.FixtureRequest, tmp_path: Path) -> Img:
    return await build(tmp_path, request.param == "signed")


@pytest.fixture
async def plain_img(tmp_path: Path) -> Img:
    return await build(tmp_path, False)


# --- running every reading path ----------------------------------------------------------------


def tree(root: Path) -> set[str]:
    """Every path under ``root`` (files and directories) but under ``root/dest``."""
    out = set()
    for d, dirs, files in os.walk(root):
        if d == str(root):
            dirs.remove("dest")
        for n in dirs + files:
            out.add(os.path.relpath(os.path.join(d, n), root))
    return out


async def timed(what: str, fn: Callable[[], Any]) -> BaseException | None:
    """``fn()`` within :data:`PATH_SECONDS`; its exception (a hang fails the test)."""
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(fn(), PATH_SECONDS)
    except TimeoutError:
        pytest.fail(f"{what}: hung (more than {PATH_SECONDS} s)")
    except Exception as exc:  # noqa: BLE001 - judged by the caller
        return exc
    finally:
        assert time.monotonic() - t0 < PATH_SECONDS, f"{what}: too slow"
    return None


def expected(img: Img, files: list[Any]) -> dict[str, bytes]:
    """What a manifest's files must hold: the verified plaintexts it names, in order."""
    out = {}
    for f in files:
        assert all(c.digest in img.plain for c in f.chunks), f"{f.name}: unknown chunk accepted"
        out[f.name] = b"".join(img.plain[c.digest] for c in f.chunks)
        assert len(out[f.name]) == f.size, f"{f.name}: size {f.size} but chunks hold more/less"
    return out


async def read_all(img: Img, owned: bool) -> None:
    """Every file through the reader: ``iter_file``, or ``iter_file_owned`` (which never
    fetches an all-zero chunk: its authenticated address says what it holds)."""
    async with ImageReader(img.url, settings=img.host) as r:
        got = {f.name: bytearray() for f in r.manifest.files}
        for f in r.manifest.files:
            if owned:
                async for c in r.iter_file_owned(f.name):
                    got[f.name] += c.map[: c.size]
                    c.close()
            else:
                async for b in r.iter_file(f.name):
                    got[f.name] += b
        assert got == expected(img, r.manifest.files), "the reader handed out other bytes"


async def pull(img: Img, dest: Path) -> None:
    res = await pull_image(img.url, dest, settings=img.host)
    for name, data in expected(img, res.manifest.files).items():
        assert (dest / name).read_bytes() == data, f"{name}: pulled other bytes"


def check(label: str, errors: dict[str, BaseException | None], want: type[BaseException]) -> None:
    for path, exc in errors.items():
        if exc is None:
            continue
        if isinstance(exc, AssertionError):
            raise AssertionError(f"{label}: {path}: {exc}") from exc
        if not isinstance(exc, SpotguardError):
            raise AssertionError(f"{label}: {path} raised untyped {exc!r}") from exc
        assert isinstance(exc, want), f"{label}: {path} raised {exc!r}, not a {want.__name__}"
        assert not exc.retryable, f"{label}: {path}: {exc!r} says retry"


async def attempt(
    img: Img, label: str, want: type[BaseException] = ImageError, refused: bool = False
) -> dict[str, BaseException | None]:
    """Every reading path on the image as it is now: each fails typed (``want``) or reads
    exactly the verified bytes; a failed pull writes nothing; nothing else is left behind.
    ``refused``: every path must fail."""
    dest = img.root / "dest"
    dest.mkdir()
    before = tree(img.root)
    runs = {
        "reader": lambda: read_all(img, owned=False),
        "owned": lambda: read_all(img, owned=True),
        "verify": lambda: verify_image(img.url, settings=img.host),
        "pull": lambda: pull(img, dest),
    }
    got = await asyncio.gather(*(timed(f"{label}: {k}", run) for k, run in runs.items()))
    errors = dict(zip(runs, got, strict=True))
    check(label, errors, want)
    if errors["pull"] is not None:
        assert os.listdir(dest) == [], f"{label}: a failed pull left {os.listdir(dest)}"
    assert tree(img.root) == before, f"{label}: files left behind"
    if refused:
        assert all(errors.values()), (
            f"{label}: accepted by {[k for k, v in errors.items() if not v]}"
        )
    # rm, not shutil.rmtree: however deep a bad pull went, no recursion limit
    await asyncio.to_thread(lambda: subprocess.run(["rm", "-rf", "--", str(dest)], check=True))
    return errors


async def with_manifest(img: Img, label: str, data: bytes | dict[str, Any], **kw: Any) -> None:
    img.manifest_path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    try:
        await attempt(img, label, **kw)
    finally:
        img.manifest_path.write_bytes(img.written)


# --- the manifest ------------------------------------------------------------------------------


def paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every member and element of a JSON value, containers included, by its path."""
    if at:
        yield at
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for k, v in items:
        yield from paths(v, (*at, k))


def replaced(raw: dict[str, Any], at: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    node = out
    for k in at[:-1]:
        node = node[k]
    node[at[-1]] = value
    return out


async def test_the_written_image_reads_back_on_every_path(img: Img) -> None:
    errors = await attempt(img, "untouched")
    assert errors == dict.fromkeys(("reader", "owned", "verify", "pull"))


async def test_a_truncated_manifest_is_refused(img: Img) -> None:
    n = len(img.written)
    rng = random.Random(SEED)
    cuts = sorted({*range(0, 24), *range(n - 24, n), *rng.sample(range(24, n - 24), 32)})
    for cut in cuts:
        await with_manifest(img, f"manifest cut at {cut}/{n}", img.written[:cut], refused=True)


async def test_wrong_types_in_every_field(img: Img) -> None:
    """Each member of the manifest (containers too) replaced by values of other types and
    out-of-range numbers; a signed image must refuse every change."""
    raw = img.raw()
    rng = random.Random(SEED)
    signed = bool(raw["auth"])
    for at in paths(raw):
        for value in rng.sample(BAD_VALUES, 1 if signed else 3):
            m = replaced(raw, at, value)
            if m == raw:
                continue
            label = f"{'.'.join(map(str, at))} = {value!r}"
            await with_manifest(img, label, m, refused=signed)


@pytest.mark.parametrize(
    ("at", "value"),
    [
        (("files", 0, "size"), 2**70),  # ftruncate: OverflowError
        (("files", 1, "size"), 2**62),
        (("codec", "chunk_size"), 2**70),  # owned reads size a buffer by it: OverflowError
        (("codec", "chunk_size"), 1 << 40),
        (("codec", "chunk_size"), -(2**70)),
        (("meta", "note"), "\ud800"),  # a lone surrogate: UnicodeEncodeError
        (("image_id",), "\udfff"),
    ],
)
async def test_out_of_range_values_are_refused(
    plain_img: Img, at: tuple[Any, ...], value: Any
) -> None:
    await with_manifest(
        plain_img, f"{at} = {value!r}", replaced(plain_img.raw(), at, value), refused=True
    )


async def test_manifest_text_mutations(img: Img) -> None:
    """Bytes flipped, inserted and deleted anywhere in the manifest; numbers JSON cannot
    hold; a valid manifest must still authenticate and add up."""
    rng = random.Random(SEED)
    text = img.written
    for i in range(60):
        b = bytearray(text)
        pos = rng.randrange(len(b))
        op = i % 3
        if op == 0:
            b[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[pos:pos] = bytes([rng.choice(b'{}[]",:0-9e\\\x00\xff')])
        else:
            del b[pos : pos + rng.randrange(1, 8)]
        await with_manifest(img, f"byte mutation {i} at {pos}", bytes(b))
    size = b'"size": %d' % len(img.plain[img.raw()["files"][1]["chunks"][0]["digest"]])
    assert size in text
    for repl in (b"NaN", b"Infinity", b"-Infinity", b"1e999", b"9" * 5000, b"1" + b"0" * 30):
        await with_manifest(
            img, f"size {repl[:12]!r}", text.replace(size, b'"size": ' + repl), refused=True
        )


HOSTILE_NAMES = [
    "../x",
    "/etc/x",
    "a/../../b",
    "",
    ".",
    "a//b",
    "a/",
    "./a",
    "a\x00b",
    "\ud800",
    "x" * 300,
    "d/" + "y" * 300,
    "a/" * 2000 + "z",
    "z" * 5000,
    "sub",  # also a directory (sub/core-1.img)
    "sub/core-1.img/z",  # under a file
    "again.img",  # twice
]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=[repr(n[:16]) for n in HOSTILE_NAMES])
async def test_hostile_file_names_are_refused(plain_img: Img, name: str) -> None:
    raw = plain_img.raw()
    await with_manifest(
        plain_img, f"name {name[:40]!r}", replaced(raw, ("files", 0, "name"), name), refused=True
    )


async def test_file_names_that_are_fine_are_read(plain_img: Img) -> None:
    raw = plain_img.raw()
    for name in ("pages-2.img", "deep/er/ünï cødé.img", "sub/x"):
        errors = await attempt_with(plain_img, replaced(raw, ("files", 0, "name"), name))
        assert errors == dict.fromkeys(("reader", "owned", "verify", "pull")), name


async def attempt_with(img: Img, m: dict[str, Any]) -> dict[str, BaseException | None]:
    img.manifest_path.write_bytes(json.dumps(m).encode())
    try:
        return await attempt(img, f"{m['files'][0]['name']!r}")
    finally:
        img.manifest_path.write_bytes(img.written)


def size_mutations(raw: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Sizes and chunk references that do not add up to the files they describe."""
    f0 = raw["files"][0]
    total = f0["size"]
    for delta in (1, -1, CHUNK, -CHUNK, total):
        yield f"file size {delta:+d}", replaced(raw, ("files", 0, "size"), total + delta)
    for i, c in enumerate(f0["chunks"]):
        for size in (c["size"] + 1, c["size"] - 1, 1, 1 << 30):
            m = replaced(raw, ("files", 0, "chunks", i, "size"), size)
            yield f"chunk {i} size {size}", m
            m = copy.deepcopy(m)
            m["files"][0]["size"] += size - c["size"]  # the file agrees: the chunk does not
            yield f"chunk {i} size {size}, file too", m
        yield f"chunk {i} missing", replaced(raw, ("files", 0, "chunks", i, "digest"), "ab" * 32)
        yield (
            f"chunk {i} raw flipped",
            replaced(raw, ("files", 0, "chunks", i, "raw"), not c["raw"]),
        )
        yield f"chunk {i} stored_size 0", replaced(raw, ("files", 0, "chunks", i, "stored_size"), 0)
        m = copy.deepcopy(raw)
        del m["files"][0]["chunks"][i]
        yield f"chunk {i} dropped", m
    m = copy.deepcopy(raw)
    m["files"][0]["chunks"].append(m["files"][2]["chunks"][0])
    yield "chunk appended", m
    m = copy.deepcopy(raw)
    cs = m["files"][0]["chunks"]
    cs[0]["digest"], cs[2]["digest"] = cs[2]["digest"], cs[0]["digest"]
    yield "chunk addresses swapped", m
    m = copy.deepcopy(raw)
    m["files"][1]["chunks"] = []
    yield "chunks of a non-empty file dropped", m


async def test_sizes_and_chunk_references_that_do_not_add_up(img: Img) -> None:
    for label, m in size_mutations(img.raw()):
        await with_manifest(img, label, m)  # each is refused, or reads exactly what it names


async def test_another_images_manifest(img: Img) -> None:
    """Image B's (genuine) manifest at image A's key: refused (it names another image)."""
    ws = settings(signing_key_file=img.root / "k.key") if img.raw()["auth"] else settings()
    plain_b = await write(img.root, "img-b", SEED + 1, ws)
    b_path = img.store_dir / manifest_key(JOB, "img-b")
    other = b_path.read_bytes()
    b_path.unlink()  # only A stays, so the signed host sees no rollback
    await with_manifest(img, "image B's manifest", other, refused=True)
    m = json.loads(other)
    m["image_id"] = img.image_id  # made to look like A: a forgery for a host with keys
    img.plain.update(plain_b)
    await with_manifest(
        img, "image B's manifest, renamed A", m, want=ImageError, refused=bool(m["auth"])
    )
    m["job"] = "other"
    await with_manifest(img, "another job's manifest", m, refused=True)


# --- the chunk objects -------------------------------------------------------------------------


def zstd_frame(content_size: int | None, blocks: int) -> bytes:
    """A zstd frame of RLE blocks (128 KiB of zeros each, 4 bytes stored) declaring
    ``content_size`` (None: not declared): a decompression bomb."""
    if content_size is None:
        head = bytes([0x00, 0x58])  # no content size; window descriptor: 8 MiB
    else:
        head = bytes([0xE0]) + content_size.to_bytes(8, "little")
    body = b"".join(
        (((128 << 10) << 3) | 0b10 | int(i == blocks - 1)).to_bytes(3, "little") + b"\x00"
        for i in range(blocks)
    )
    return b"\x28\xb5\x2f\xfd" + head + body


def chunk_mutations(stored: bytes, size: int, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """Damaged objects for a chunk of ``size`` bytes stored as ``stored``; the names of those
    that may still decode to its bytes start with ``+``."""
    n = len(stored)
    for cut in (0, 4, 13, n // 2, n - 1):
        yield f"cut to {cut}", stored[:cut]
    yield "+one byte more", stored + b"\x00"
    yield "+a frame more", stored + zstandard.ZstdCompressor().compress(b"more")
    yield "+far longer", stored + bytes(size + 8192)
    for pos in [rng.randrange(n) for _ in range(4)] + [n // 2]:
        b = bytearray(stored)
        b[pos] ^= 1 << rng.randrange(8)
        # a flip in a frame's header may leave what it decodes to intact (then its bytes
        # verify); in the middle of a raw frame's data it may not
        keeps = "" if n > 4096 and pos == n // 2 else "+"
        yield f"{keeps}bit flipped at {pos}", bytes(b)
    cctx = zstandard.ZstdCompressor(write_content_size=True)
    yield "another frame, same size", cctx.compress(rng.randbytes(size))
    yield "another frame, one byte less", cctx.compress(bytes(size - 1))
    yield "another frame, one byte more", cctx.compress(bytes(size + 1))
    yield (
        "frame without content size",
        zstandard.ZstdCompressor(write_content_size=False).compress(b"\x01" * size),
    )
    yield "bomb declaring 1 TiB", zstd_frame(1 << 40, 8)
    yield "bomb declaring 2**62", zstd_frame(1 << 62, 1)
    yield "bomb declaring 1 GiB, 1 GiB of blocks", zstd_frame(1 << 30, min(2048, n // 4))
    yield "bomb of undeclared size", zstd_frame(None, min(8192, n // 4))
    yield "window of 2 GiB", b"\x28\xb5\x2f\xfd\x00\xa8" + b"\x01\x00\x00"
    yield "not zstd", rng.randbytes(n)


async def test_damaged_chunk_objects(img: Img) -> None:
    """Each chunk object truncated, extended, bit-flipped, replaced or deleted: refused as
    corrupt naming the chunk, on every path that fetches it (``iter_file_owned`` never fetches
    an all-zero chunk: it reads it right)."""
    rng = random.Random(SEED)
    zero = {d for d, p in img.plain.items() if not any(p)}
    assert len(zero) == 1 and len(img.plain) == 4
    for digest, data in img.plain.items():
        path = img.chunk_path(digest)
        stored = path.read_bytes()
        cases = [*chunk_mutations(stored, len(data), rng), ("deleted", None)]
        for what, bad in cases:
            label = f"chunk {digest[:8]} ({len(data)} B, {len(stored)} stored): {what}"
            path.unlink()
            if bad is not None:
                path.write_bytes(bad)
            try:
                errors = await attempt(img, label, want=ImageCorrupt)
            finally:
                path.write_bytes(stored)
            for where, exc in errors.items():
                if digest in zero and where == "owned":
                    assert exc is None, f"{label}: {where}: {exc!r}"
                    continue
                if what.startswith("+") and exc is None:
                    continue  # it decoded to the chunk's bytes (verified: attempt checks them)
                assert isinstance(exc, ImageCorrupt), f"{label}: {where} accepted it"
                assert exc.chunk == digest, f"{label}: {where}: {exc!r}"


async def test_signed_image_with_a_forged_chunk_list(tmp_path: Path) -> None:
    """A signed manifest altered in its chunk list (as the size mutations do) is refused
    before any chunk is read: malformed, or (where it adds up) a bad signature."""
    img = await build(tmp_path, True)
    for label, m in size_mutations(img.raw()):
        await with_manifest(img, label, m, refused=True)
    m = img.raw()
    m["auth"][0]["sig"] = m["auth"][0]["sig"][::-1]
    await with_manifest(img, "signature reversed", m, want=BadSignature, refused=True)
