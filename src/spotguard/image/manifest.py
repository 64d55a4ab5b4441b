"""The manifest (the typed model of ``manifest.json``) and image URLs.

An image is ``{store}/{job}/images/{image_id}``; it exists once its ``manifest.json`` exists.
See docs/image-format.md for the format this model writes.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from spotguard.errors import ConfigError, ImageError
from spotguard.names import check_job_name, image_prefix, manifest_key
from spotguard.store.base import ImageStore, get_capped

#: bounds on what is read from a store before it is parsed (a 40 GiB image's manifest is
#: about 2 MB; the deepest genuine nesting is under 10 levels)
MAX_MANIFEST_BYTES = 64 << 20
MAX_DEPTH = 64
MAX_CHUNK_BYTES = 1 << 30

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
        return v


class Codec(BaseModel):
    """How chunks are cut, addressed and compressed."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["zstd"] = "zstd"
    level: int = 1
    chunk_size: int
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

    def file(self, name: str) -> FileEntry:
        for f in self.files:
            if f.name == name:
                return f
        raise ImageError(f"image {self.job}/{self.image_id} has no file {name!r}")

    def chunk_refs(self) -> dict[str, ChunkRef]:
        """Every distinct chunk, by address."""
        return {c.digest: c for f in self.files for c in f.chunks}

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=False).encode()

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
        bounded before they are parsed: at most :data:`MAX_MANIFEST_BYTES` (callers read them
        with that cap, :func:`read_manifest`) and :data:`MAX_DEPTH` levels of nesting; every
        failure is an :class:`ImageError` (never ``RecursionError`` or ``MemoryError``)."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ImageError(
                f"manifest of {where} is larger than {MAX_MANIFEST_BYTES} bytes: refused unread"
            )
        depth = json_depth(data)
        if depth > MAX_DEPTH:
            raise ImageError(
                f"manifest of {where} nests {depth}+ levels deep (at most {MAX_DEPTH}): refused"
            )
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ImageError(f"manifest of {where} is not JSON: {str(exc)[:200]}") from exc
        fmt = raw.get("format") if isinstance(raw, dict) else None
        if fmt not in READABLE:
            raise ImageError(
                f"manifest of {where} has format {fmt!r}; this build reads {', '.join(READABLE)}"
            )
        try:
            return cls.model_validate(raw), raw
        except (ValidationError, RecursionError, ValueError, TypeError) as exc:
            first = str(exc).splitlines()
            raise ImageError(
                f"manifest of {where} is malformed: {' '.join(first[:3])[:300]}"
            ) from exc


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {0x5B: 1, 0x7B: 1, 0x5D: -1, 0x7D: -1}


def json_depth(data: bytes) -> int:
    """How deep ``data``'s arrays and objects nest (counted outside strings): checked before
    ``json.loads``, whose recursion a few hundred thousand ``[`` would exhaust, and before
    anything walks the parsed value (validation, canonical re-serialisation)."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKET)
    return max(itertools.accumulate(_STEP[b] for b in brackets), default=0)


async def fetch_manifest(
    store: ImageStore, key: str, where: str
) -> tuple[Manifest, dict[str, Any]]:
    """Read the manifest at ``key`` with a cap (:data:`MAX_MANIFEST_BYTES`: a larger object is
    never read whole) and parse it (:meth:`Manifest.parse`). Raises the store's errors
    (:class:`~spotguard.errors.ObjectNotFound`) and :class:`ImageError`."""
    data = await get_capped(store, key, MAX_MANIFEST_BYTES)
    return Manifest.parse(data, where)


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
        ``image_id`` may be ``latest``, resolved later by :func:`spotguard.image.resolve`."""
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
