"""The manifest (the typed model of ``manifest.json``) and image URLs.

An image is ``{store}/{job}/images/{image_id}``; it exists once its ``manifest.json`` exists.
See docs/image-format.md for the format this model writes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from spotguard.errors import ConfigError, ImageError
from spotguard.names import check_job_name, image_prefix, manifest_key
from spotguard.store import check_url
from spotguard.store.base import ImageStore, get_capped

#: Bounds on what is read from a store before it is parsed. A genuine manifest takes about 154
#: bytes per chunk reference and 90 per file plus its ``meta`` (a real 0.8 GiB CRIU image:
#: 25 files, 35 chunks, 17 KB; at the default 64 MiB chunks about 2.5 KB per GiB of image, so a
#: 1 TiB image's manifest is about 2.6 MB). MAX_CHUNKS chunk references make 4 TiB at 64 MiB
#: chunks and 1 TiB at 16 MiB (docs/image-format.md, "Limits"); the writer refuses a manifest
#: its readers would refuse (:meth:`Manifest.to_bytes`).
MAX_MANIFEST_BYTES = 16 << 20
MAX_FILES = 16384
MAX_CHUNKS = 65536
MAX_META_OBJECTS = 4096  # JSON objects in ``meta`` (timeline entries, GPU devices, ...)
MAX_OBJECTS = 1 + MAX_FILES + MAX_CHUNKS + MAX_META_OBJECTS + 16
MAX_ARRAYS = MAX_FILES + MAX_META_OBJECTS + 16
MAX_VALUES = 1 << 19  # commas: a chunk reference has 4 members, a file 4, meta the rest
MAX_DEPTH = 64
MAX_CHUNK_BYTES = 1 << 30
#: Bounds on a file's name (UTF-8 bytes): what a restore can create under any destination
#: (NAME_MAX per part; well within PATH_MAX with the destination in front), in few enough
#: directories that removing what a failed pull made never recurses deeply. CRIU's names are
#: about 20 bytes.
MAX_NAME_BYTES = 1024
MAX_NAME_PART_BYTES = 255
MAX_NAME_PARTS = 32

FORMAT = "spotguard-image/2"
READABLE = ("spotguard-image/1", FORMAT)  # /1: no sequence, no auth, no raw frames
WRITING_MARKER = "writing.json"  # under the image prefix while a writer is active


class ChunkRef(BaseModel):
    """One chunk of a file: its address (``digest``: the BLAKE3 hash of its plaintext, keyed
    for encrypted images), plaintext size and stored (compressed) size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(gt=0, le=MAX_CHUNK_BYTES)
    stored_size: int = Field(ge=0)
    raw: bool = False  # stored as a raw (uncompressed) zstd frame: it did not compress


class FileEntry(BaseModel):
    """One file of the image directory, by its ``/``-separated relative name."""

    model_config = ConfigDict(extra="forbid")

    name: str
    size: int = Field(ge=0)
    mode: int = Field(default=0o644, ge=0, le=0o777)  # permission bits only: no setuid/setgid/type
    chunks: list[ChunkRef] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _relative(cls, v: str) -> str:
        parts = v.split("/")
        if not v or v.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"file name {v!r} must be a relative path without . or ..")
        # What a restore creates: no NUL, text the file system takes (UTF-8, so no lone
        # surrogate), within the bounds above (else open() raises ValueError or OSError).
        try:
            encoded = v.encode()
        except UnicodeEncodeError:
            encoded = b"\0"
        if b"\0" in encoded:
            raise ValueError(f"file name {v[:64]!r} holds NUL or text that is not Unicode")
        longest = max(len(p.encode()) for p in parts)
        if (
            len(encoded) > MAX_NAME_BYTES
            or longest > MAX_NAME_PART_BYTES
            or len(parts) > MAX_NAME_PARTS
        ):
            raise ValueError(
                f"file name {v[:64]!r}… ({len(encoded)} bytes, {len(parts)} parts, the longest "
                f"{longest} bytes) is longer than {MAX_NAME_BYTES} bytes, {MAX_NAME_PARTS} parts "
                f"or {MAX_NAME_PART_BYTES} bytes a part"
            )
        return v


class Codec(BaseModel):
    """How chunks are cut, addressed and compressed."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["zstd"] = "zstd"
    level: int = 1
    chunk_size: int = Field(gt=0, le=MAX_CHUNK_BYTES)  # sizes a reader's buffers
    hash: Literal["blake3"] = "blake3"


class Encryption(BaseModel):
    """How chunks are encrypted; ``key_id`` identifies (never reveals) the key."""

    model_config = ConfigDict(extra="forbid")

    alg: Literal["AES-256-GCM"] = "AES-256-GCM"
    key_id: str
    address: Literal["BLAKE3-keyed"] = "BLAKE3-keyed"


class Signature(BaseModel):
    """One authenticator of the manifest (see :mod:`spotguard.image.keys`): an Ed25519
    signature (``sig`` base64) or an HMAC-SHA256 (``sig`` hex) under ``key_id``."""

    model_config = ConfigDict(extra="forbid")

    alg: Literal["ed25519", "hmac-sha256"]
    key_id: str = Field(max_length=64)
    sig: str = Field(max_length=256)


class Totals(BaseModel):
    """Sizes over the whole image (``stored_bytes`` counts every chunk reference once)."""

    model_config = ConfigDict(extra="forbid")

    files: int = 0
    chunks: int = 0
    unique_chunks: int = 0
    bytes: int = 0
    stored_bytes: int = 0


class Manifest(BaseModel):
    """``manifest.json``: the complete description of one image."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["spotguard-image/1", "spotguard-image/2"] = "spotguard-image/2"
    job: str
    image_id: str
    sequence: int = Field(default=0, ge=0)  # per job, increasing: newer images have larger ones
    created: datetime = Field(default_factory=lambda: datetime.now(UTC))
    codec: Codec
    encryption: Encryption | None = None
    files: list[FileEntry] = Field(default_factory=list)
    totals: Totals = Field(default_factory=Totals)
    meta: dict[str, Any] = Field(default_factory=dict)
    auth: list[Signature] = Field(default_factory=list)  # not covered by itself

    @field_validator("job")
    @classmethod
    def _job(cls, v: str) -> str:
        return check_job_name(v)

    def check_bounds(self, where: str) -> None:
        """:class:`ImageError` when the manifest has more files or chunk references than a
        reader accepts (:data:`MAX_FILES`, :data:`MAX_CHUNKS`)."""
        chunks = sum(len(f.chunks) for f in self.files)
        if len(self.files) > MAX_FILES or chunks > MAX_CHUNKS:
            raise ImageError(
                f"manifest of {where} has {len(self.files)} files and {chunks} chunk references "
                f"(at most {MAX_FILES} and {MAX_CHUNKS}: a larger chunk_size makes fewer)"
            )

    def check_files(self, where: str) -> None:
        """:class:`ImageError` when the files cannot be restored as described: a file whose
        chunks do not add up to its size (a restore would leave zeros or more bytes than the
        manifest says), or a name given twice or both to a file and to a directory of
        another. The writer never makes one; a store attacker may."""
        names: set[str] = set()
        dirs: set[str] = set()
        for f in self.files:
            held = sum(c.size for c in f.chunks)
            if held != f.size:
                raise ImageError(
                    f"manifest of {where}: file {f.name!r} has {f.size} bytes, its chunks {held}"
                )
            if f.name in names:
                raise ImageError(f"manifest of {where} names file {f.name!r} twice")
            names.add(f.name)
            parts = f.name.split("/")
            dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        clash = names & dirs
        if clash:
            raise ImageError(
                f"manifest of {where}: {sorted(clash)[0]!r} is both a file and a directory"
            )

    def file(self, name: str) -> FileEntry:
        for f in self.files:
            if f.name == name:
                return f
        raise ImageError(f"image {self.job}/{self.image_id} has no file {name!r}")

    def chunk_refs(self) -> dict[str, ChunkRef]:
        """Every distinct chunk, by address."""
        return {c.digest: c for f in self.files for c in f.chunks}

    def to_bytes(self) -> bytes:
        """The manifest's JSON; :class:`ImageError` when readers would refuse it (more than
        :data:`MAX_MANIFEST_BYTES` or the shape limits): never an image that cannot be read."""
        where = f"image {self.job}/{self.image_id} (as written)"
        self.check_bounds(where)
        self.check_files(where)
        data = json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=False).encode()
        check_shape(data, where)
        return data

    def unsigned(self) -> dict[str, Any]:
        """The manifest as JSON data without ``auth``: what authenticators cover."""
        raw: dict[str, Any] = json.loads(self.to_bytes())
        raw.pop("auth", None)
        return raw

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        """Parse a manifest; a foreign or damaged one is an :class:`ImageError`."""
        return cls.parse(data, where)[0]

    @classmethod
    def parse(cls, data: bytes, where: str) -> tuple[Manifest, dict[str, Any]]:
        """The manifest and the JSON data it was parsed from (what authentication checks).

        Anyone who can write the store can put anything at a manifest's key, so the bytes are
        bounded before they are parsed (:func:`check_shape`: size, counts of objects, arrays and
        values, nesting); every failure is an :class:`ImageError` (never ``RecursionError`` or
        ``MemoryError``). CPU-bound: async callers run it in a thread (:func:`fetch_manifest`)."""
        check_shape(data, where)
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ImageError(f"manifest of {where} is not JSON: {str(exc)[:200]}") from exc
        if _SURROGATE.search(data):  # an escape of one; checked whole only then (it costs)
            try:
                json.dumps(raw, ensure_ascii=False).encode()
            except UnicodeEncodeError as exc:  # authentication and files would meet it later
                raise ImageError(
                    f"manifest of {where} holds text that is not Unicode (a lone surrogate)"
                ) from exc
        fmt = raw.get("format") if isinstance(raw, dict) else None
        if fmt not in READABLE:
            raise ImageError(
                f"manifest of {where} has format {fmt!r}; this build reads {', '.join(READABLE)}"
            )
        try:
            m = cls.model_validate(raw)
        except (ValidationError, RecursionError, ValueError, TypeError) as exc:
            first = str(exc).splitlines()
            raise ImageError(
                f"manifest of {where} is malformed: {' '.join(first[:3])[:300]}"
            ) from exc
        m.check_bounds(where)
        m.check_files(where)
        return m, raw


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {0x5B: 1, 0x7B: 1, 0x5D: -1, 0x7D: -1}


def check_shape(data: bytes, where: str) -> None:
    """Refuse (:class:`ImageError`) bytes that no genuine manifest has, before ``json.loads``
    turns them into objects: more than :data:`MAX_MANIFEST_BYTES`, more JSON objects, arrays
    or values (commas) than :data:`MAX_FILES` files and :data:`MAX_CHUNKS` chunk references
    need, or deeper than :data:`MAX_DEPTH`. Counted outside strings, in C (``bytes.count``):
    16 MiB of ``{},`` would otherwise parse into five million dicts (about 400 MB)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ImageError(
            f"manifest of {where} is larger than {MAX_MANIFEST_BYTES} bytes: refused unread"
        )
    bare = _STRING.sub(b"", data)
    for what, n, most in (
        ("objects", bare.count(b"{"), MAX_OBJECTS),
        ("arrays", bare.count(b"["), MAX_ARRAYS),
        ("values", bare.count(b","), MAX_VALUES),
    ):
        if n > most:
            raise ImageError(
                f"manifest of {where} holds {n} JSON {what} (at most {most}): refused unparsed"
            )
    depth = _depth(bare)
    if depth > MAX_DEPTH:
        raise ImageError(
            f"manifest of {where} nests {depth}+ levels deep (at most {MAX_DEPTH}): refused"
        )


def json_depth(data: bytes) -> int:
    """How deep ``data``'s arrays and objects nest (counted outside strings): checked before
    ``json.loads``, whose recursion a few hundred thousand ``[`` would exhaust, and before
    anything walks the parsed value (validation, canonical re-serialisation)."""
    return _depth(_STRING.sub(b"", data))


def _depth(bare: bytes) -> int:
    brackets = bare.translate(None, _NOT_BRACKET)
    return max(itertools.accumulate(_STEP[b] for b in brackets), default=0)


class ManifestBudget:
    """Manifest bytes read and parsed at once by one scan (a job's images, a listing): with
    16 requests in flight, 16 manifests at the cap would otherwise be held together. A
    reservation larger than the budget waits until it is the only one."""

    def __init__(self, limit: int = MAX_MANIFEST_BYTES) -> None:
        self.limit = limit
        self._used = 0
        self._cond = asyncio.Condition()

    @asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        n = min(max(size, 1), self.limit)
        async with self._cond:
            await self._cond.wait_for(lambda: self._used + n <= self.limit)
            self._used += n
        try:
            yield
        finally:
            self._used -= n
            async with self._cond:
                self._cond.notify_all()


async def fetch_manifest(
    store: ImageStore, key: str, where: str, *, size: int | None = None
) -> tuple[Manifest, dict[str, Any]]:
    """Read the manifest at ``key`` with a cap and parse it in a thread (:meth:`Manifest.parse`).
    The cap is :data:`MAX_MANIFEST_BYTES`, or ``size`` (what a listing said) when given: a
    larger object is never read whole, and one the listing shows over the cap is not read at
    all. Raises the store's errors (:class:`~spotguard.errors.ObjectNotFound`) and
    :class:`ImageError`."""
    cap = MAX_MANIFEST_BYTES if size is None or size <= 0 else size
    if cap > MAX_MANIFEST_BYTES:
        raise ImageError(
            f"manifest of {where} is {cap} bytes, more than {MAX_MANIFEST_BYTES}: refused unread"
        )
    data = await get_capped(store, key, cap)
    if len(data) > cap:
        raise ImageError(f"manifest of {where} is larger than {cap} bytes: refused")
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_PARSER, Manifest.parse, data, where)


#: one thread parses manifests, off the event loop: parsing holds the GIL, so more threads
#: would not parse faster, and each would keep its own malloc arena of freed parse memory
#: (16 junk manifests of 15 MiB: 105 MiB more peak RSS across the default pool's threads
#: than one thread's 30 MiB)
_PARSER = ThreadPoolExecutor(1, thread_name_prefix="manifest-parse")


def max_stored_chunk(size: int) -> int:
    """The most bytes a stored chunk of ``size`` plaintext bytes can take (zstd's bound,
    a raw frame's header, AES-GCM's nonce and tag): a larger object at its address is
    refused after reading that much, never read whole."""
    return size + (size >> 7) + 4096


@dataclass(frozen=True)
class ImageRef:
    """Where an image lives: store URL, job and image id."""

    store: str
    job: str
    image_id: str

    @property
    def url(self) -> str:
        return f"{self.store.rstrip('/')}/{image_prefix(self.job, self.image_id)}"

    @property
    def manifest_key(self) -> str:
        return manifest_key(self.job, self.image_id)

    @property
    def prefix(self) -> str:
        return image_prefix(self.job, self.image_id)

    @classmethod
    def parse(cls, url: str) -> ImageRef:
        """Split ``{store}/{job}/images/{image_id}`` (a trailing ``/manifest.json`` is fine).
        ``image_id`` may be ``latest``, resolved later by :func:`spotguard.image.resolve`.
        The store part is checked as :func:`~spotguard.store.check_url` does (a known scheme,
        a bucket), so a mistyped URL is not read as a directory named after it."""
        check_url(url)
        u = url.rstrip("/")
        if u.endswith("/manifest.json"):
            u = u[: -len("/manifest.json")]
        parts = u.rsplit("/", 3)
        if len(parts) != 4 or parts[2] != "images" or not parts[3]:
            raise ConfigError(
                f"{url!r} is not an image URL: expected STORE/JOB/images/IMAGE_ID "
                "(or STORE/JOB/images/latest)"
            )
        store, job, _, image_id = parts
        try:
            check_job_name(job)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        return cls(store or "/", job, image_id)
