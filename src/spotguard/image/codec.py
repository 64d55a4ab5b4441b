"""Chunk encoding: address, compress, encrypt — and the reverse with verification.

A chunk's **address** (its ``digest`` in the manifest and its store key) is a BLAKE3 hash of
the chunk's *plaintext*:

* without encryption: ``BLAKE3(plaintext)``;
* with encryption: keyed ``BLAKE3(k_addr, plaintext)`` (BLAKE3's keyed mode is a MAC), so the
  store never learns plaintext hashes (which would let anyone confirm a guess of a chunk's
  content).

BLAKE3 because every plaintext byte is hashed on the way up and again on the way back: it runs
at about 7 GB/s per core here, against 1.9 GB/s for SHA-256 with SHA extensions — which cost as
much CPU as zstd level 1 and decided the throughput on small machines.

The **stored object** is one independent zstd frame of the plaintext (content size in the
frame header); with encryption it is ``b"SGE1" || nonce || AES-256-GCM(frame)`` where the nonce
is the first 12 bytes of keyed ``BLAKE3(k_nonce, address)`` and the address is the associated
data.

Why plaintext addressing: an unchanged chunk is recognised *before* it is compressed, so a
periodic checkpoint of a job whose memory barely changed costs one hash per chunk, not a
compression; and the address does not change when the zstd level or library changes.
Verification decodes the stored bytes and re-computes the address: a flipped bit anywhere
(ciphertext, frame or content) is caught. With encryption the GCM tag catches it first.

The nonce is deterministic — the price of dedup under encryption: equal plaintext chunks give
equal stored objects (an observer learns that two chunks are equal, nothing more). Distinct
plaintexts get distinct nonces, as the address is collision-resistant, so GCM's "never reuse a
nonce with different data" holds. Subkeys come from the master key by HKDF-SHA256.

**Raw frames.** GPU memory is often near-incompressible (random-looking weights, optimizer
state): zstd then spends most of a core per 1.5 GB/s to save nothing. :meth:`ChunkCodec.pack`
first compresses a sample (8 slices of 32 KiB spread over the chunk); when it saves less than
``raw_saving`` (default 3 %), the chunk is stored as a zstd frame of *raw blocks* — the
plaintext behind a frame header and a 3-byte header per 128 KiB block, built by copying, no
compressor. It is still a standard zstd frame (every reader, older builds included, decodes it
at memory speed); the address is still BLAKE3 of the plaintext; the manifest marks the chunk
``raw``.

The ``*_into`` methods work in caller-owned buffers (see :mod:`spotguard.image.buffers`):
compressing into and decompressing into reused memory avoids a fresh 64 MiB allocation per
chunk, whose page faults cost as much as the codec itself.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import zstandard
from blake3 import blake3

from spotguard.errors import ConfigError, DecryptionError, ImageCorrupt
from spotguard.image import memops
from spotguard.image.rawframe import (
    copy_raw_into,
    raw_frame_into,
    raw_frame_size,
    raw_frame_spans,
)

ENC_MAGIC = b"SGE1"
ENC_ALG = "AES-256-GCM"
HASH = "blake3"
KEYED_HASH = "blake3-keyed"
DIGEST_HEX = 64
KEY_BYTES = 32
NONCE_BYTES = 12
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
SAMPLES = 8
SAMPLE_BYTES = 32 << 10

_local = threading.local()


def _hkdf(key: bytes, info: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"spotguard-image/1", info=info).derive(
        key
    )


@dataclass(frozen=True)
class Cipher:
    """A master key and the subkeys derived from it."""

    key_id: str
    addr_key: bytes
    nonce_key: bytes
    enc_key: bytes
    mac_key: bytes  # authenticates manifests (spotguard.image.keys)

    @classmethod
    def from_key(cls, key: bytes) -> Cipher:
        if len(key) != KEY_BYTES:
            raise ConfigError(f"encryption key must be {KEY_BYTES} bytes, got {len(key)}")
        return cls(
            key_id=_hkdf(key, b"key-id")[:8].hex(),
            addr_key=_hkdf(key, b"address"),
            nonce_key=_hkdf(key, b"nonce"),
            enc_key=_hkdf(key, b"encrypt"),
            mac_key=_hkdf(key, b"manifest-mac"),
        )

    def __repr__(self) -> str:  # never print key material
        return f"Cipher(key_id={self.key_id!r})"


def parse_key(text: bytes) -> bytes:
    """A 32-byte key from raw bytes, hex text or base64 text."""
    if len(text) == KEY_BYTES:
        return text
    s = text.strip()
    if len(s) == 2 * KEY_BYTES:
        try:
            return binascii.unhexlify(s)
        except binascii.Error:
            pass
    try:
        raw = base64.b64decode(s, validate=True)
    except binascii.Error:
        raw = b""
    if len(raw) == KEY_BYTES:
        return raw
    raise ConfigError(
        f"encryption key must be {KEY_BYTES} bytes: raw, {2 * KEY_BYTES} hex digits or base64"
    )


def load_key(key_file: Path | None, key_text: str | None) -> Cipher | None:
    """The cipher from a key file (preferred) or key text; None when neither is set."""
    if key_file is not None:
        try:
            data = Path(key_file).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read encryption key file {key_file}: {exc}") from exc
        return Cipher.from_key(parse_key(data))
    if key_text:
        return Cipher.from_key(parse_key(key_text.encode()))
    return None


def generate_key() -> bytes:
    """A fresh random 32-byte key."""
    return os.urandom(KEY_BYTES)


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def compress_bound(size: int) -> int:
    """Bytes a zstd frame of ``size`` plaintext bytes can take at most (ZSTD_compressBound),
    plus room for the frame header: the size of an output buffer that always suffices."""
    margin = ((128 << 10) - size) >> 11 if size < (128 << 10) else 0
    return size + (size >> 8) + margin + 4096


class _Overflow(Exception):
    """The compressed frame did not fit the output buffer (never expected; handled)."""


class _IntoSink:
    """A write-only file over a caller's buffer, for zstd's stream writer."""

    def __init__(self, out: memoryview) -> None:
        self.out = out
        self.pos = 0

    def write(self, data: Any) -> int:
        n = len(data)
        end = self.pos + n
        if end > len(self.out):
            raise _Overflow
        self.out[self.pos : end] = data
        self.pos = end
        return n

    def flush(self) -> None:
        return None


class ChunkCodec:
    """Turns plaintext chunks into stored objects and back. Thread-safe (per-thread zstd
    contexts); every method is CPU-bound and meant to run in a worker thread (BLAKE3, zstd and
    AES-GCM release the GIL on large buffers)."""

    def __init__(
        self, level: int = 1, cipher: Cipher | None = None, *, raw_saving: float = 0.0
    ) -> None:
        self.level = level
        self.cipher = cipher
        self.raw_saving = raw_saving
        self._zero_addresses: dict[int, str] = {}

    @property
    def hash_name(self) -> str:
        """The address function as recorded in the manifest."""
        return HASH if self.cipher is None else KEYED_HASH

    def address(self, plain: bytes | memoryview) -> str:
        if self.cipher is None:
            return blake3(plain).hexdigest()
        return blake3(plain, key=self.cipher.addr_key).hexdigest()

    def hasher(self) -> Any:
        """A fresh incremental hasher of the address function (keyed with a cipher)."""
        return blake3() if self.cipher is None else blake3(key=self.cipher.addr_key)

    def zero_address(self, size: int) -> str:
        """The address of ``size`` zero bytes (cached per size: a job's zero pages come in
        few chunk sizes)."""
        cache = self._zero_addresses
        addr = cache.get(size)
        if addr is None:
            h = self.hasher()
            block = bytes(min(size, 1 << 20))
            left = size
            while left:
                n = min(left, len(block))
                h.update(block[:n] if n < len(block) else block)
                left -= n
            addr = cache[size] = h.hexdigest()
        return addr

    def address_of(self, plain: bytes | memoryview) -> str:
        """:meth:`address`, with a short cut for an all-zero chunk (a compare at memory speed
        instead of a hash: zero pages are common in dumped memory — allocators' reserves,
        untouched GPU buffers)."""
        if memops.is_zero(memoryview(plain)):
            return self.zero_address(len(plain))
        return self.address(plain)

    def _nonce(self, address: str) -> bytes:
        assert self.cipher is not None
        return blake3(address.encode(), key=self.cipher.nonce_key).digest(length=NONCE_BYTES)

    def _seal(self, frame: bytes | memoryview, address: str) -> bytes:
        assert self.cipher is not None
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        nonce = self._nonce(address)
        sealed = AESGCM(self.cipher.enc_key).encrypt(nonce, frame, address.encode())
        return b"".join((ENC_MAGIC, nonce, sealed))

    def encode(self, plain: bytes | memoryview, address: str) -> bytes:
        frame = _compressor(self.level).compress(plain)
        if self.cipher is None:
            return frame
        return self._seal(frame, address)

    def encode_into(self, plain: bytes | memoryview, address: str, out: Any) -> memoryview | bytes:
        """The stored object of ``plain``, compressed into ``out`` (a writable buffer of at
        least :func:`compress_bound` bytes): a view of ``out`` — or, with encryption, new
        bytes (the ciphertext), ``out`` holding only the intermediate frame."""
        view = memoryview(out)
        sink = _IntoSink(view)
        cctx = _compressor(self.level)
        try:
            with cctx.stream_writer(
                cast(IO[bytes], sink), size=len(plain), write_size=1 << 20, closefd=False
            ) as zw:
                zw.write(plain)
        except _Overflow:  # cannot happen with a compress_bound buffer; stay correct anyway
            return self.encode(plain, address)
        frame = view[: sink.pos]
        if self.cipher is None:
            return frame
        return self._seal(frame, address)

    def incompressible(self, plain: bytes | memoryview, raw_saving: float | None = None) -> bool:
        """Whether a sample of ``plain`` compresses by less than ``raw_saving`` (default: the
        codec's; chunks under the sample's size are always compressed: the sample would be
        the chunk)."""
        n = len(plain)
        threshold = self.raw_saving if raw_saving is None else raw_saving
        if threshold <= 0 or n < 2 * SAMPLES * SAMPLE_BYTES:
            return False
        view = memoryview(plain).cast("B")
        cctx = _compressor(self.level)
        step = (n - SAMPLE_BYTES) // (SAMPLES - 1)
        packed = sum(
            len(cctx.compress(view[i * step : i * step + SAMPLE_BYTES])) for i in range(SAMPLES)
        )
        return 1 - packed / (SAMPLES * SAMPLE_BYTES) < threshold

    def address_and_raw(
        self, plain: bytes | memoryview, raw_saving: float | None = None
    ) -> tuple[str, bool]:
        """:meth:`address_of` and :meth:`incompressible` in one call: one trip to a worker
        thread per chunk instead of two (each waits for the event loop between). A chunk of
        zeros is never raw."""
        addr = self.address_of(plain)
        if addr == self.zero_address(len(plain)):
            return addr, False
        return addr, self.incompressible(plain, raw_saving)

    def pack(
        self,
        plain: bytes | memoryview,
        address: str,
        out: Any = None,
        raw: bool | None = None,
        raw_saving: float | None = None,
    ) -> tuple[memoryview | bytes, bool]:
        """The stored object of ``plain`` and whether it is a raw frame: compressed (into
        ``out`` when given, see :meth:`encode_into`) unless :meth:`incompressible` under
        ``raw_saving`` (or ``raw``, when the caller asked that already)."""
        if not (self.incompressible(plain, raw_saving) if raw is None else raw):
            if out is None:
                return self.encode(plain, address), False
            return self.encode_into(plain, address, out), False
        view = (
            memoryview(out)
            if out is not None
            else memoryview(bytearray(raw_frame_size(len(plain))))
        )
        frame = raw_frame_into(plain, view)
        if self.cipher is None:
            return frame, True
        return self._seal(frame, address), True

    def _open(self, stored: bytes | memoryview, address: str) -> bytes | memoryview:
        """The zstd frame inside a stored object (decrypted and authenticated if needed)."""
        if self.cipher is None:
            return stored
        if bytes(stored[:4]) != ENC_MAGIC or len(stored) < 4 + NONCE_BYTES + 16:
            raise ImageCorrupt(f"chunk {address} is not an encrypted chunk", chunk=address)
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        nonce = bytes(stored[4 : 4 + NONCE_BYTES])
        try:
            return AESGCM(self.cipher.enc_key).decrypt(
                nonce, stored[4 + NONCE_BYTES :], address.encode()
            )
        except InvalidTag as exc:
            raise ImageCorrupt(
                f"chunk {address} failed authentication (corrupt)", chunk=address
            ) from exc

    def _copy_raw(
        self, frame: memoryview, spans: list[tuple[int, int, int]], plain: memoryview, address: str
    ) -> memoryview:
        """Decode a raw frame: its blocks copied into ``plain`` (without the GIL) and hashed
        a megabyte at a time while in cache — one pass over memory instead of zstd's copy
        and then a hash over the whole chunk."""
        hasher = self.hasher()
        copy_raw_into(hasher, frame, spans, plain)
        if not hmac.compare_digest(hasher.hexdigest(), address):
            raise ImageCorrupt(f"chunk {address} fails its hash check", chunk=address)
        return plain

    def _verify(self, plain: bytes | memoryview, address: str, size: int) -> None:
        if len(plain) != size:
            raise ImageCorrupt(
                f"chunk {address} has {len(plain)} bytes, manifest says {size}", chunk=address
            )
        if not hmac.compare_digest(self.address(plain), address):
            raise ImageCorrupt(f"chunk {address} fails its hash check", chunk=address)

    def decode(self, stored: bytes | memoryview, address: str, size: int) -> bytes:
        """The verified plaintext of a stored chunk.

        Raises :class:`ImageCorrupt` (naming the chunk) when the bytes do not decode to a
        plaintext of ``size`` bytes whose address is ``address``.
        """
        frame = self._open(stored, address)
        try:
            # zstd allocates what the frame header declares, whatever max_output_size says: a
            # frame declaring a terabyte (a few bytes in a store) would be a MemoryError, a
            # gigabyte of zeros seconds and a gigabyte of memory, before the hash could refuse it
            _check_declared(frame, address, size)
            plain = _decompressor().decompress(frame, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise ImageCorrupt(
                f"chunk {address} does not decompress: {exc}", chunk=address
            ) from exc
        self._verify(plain, address, size)
        return plain

    def decode_into(
        self, stored: bytes | memoryview, address: str, size: int, out: Any
    ) -> memoryview:
        """Like :meth:`decode`, decompressing straight into ``out`` (a writable buffer of at
        least ``size`` bytes); returns the verified view ``out[:size]``."""
        frame = self._open(stored, address)
        view = memoryview(out)
        if len(view) < size:
            raise ValueError(f"output buffer of {len(view)} bytes is smaller than {size}")
        spans = raw_frame_spans(memoryview(frame).cast("B"), size)
        if spans is not None:
            return self._copy_raw(memoryview(frame).cast("B"), spans, view[:size], address)
        try:
            _check_declared(frame, address, size)
            with _decompressor().stream_reader(
                frame, read_size=max(len(frame), 1), read_across_frames=False, closefd=False
            ) as zr:
                filled = 0
                while filled < size:
                    n = zr.readinto(view[filled:size])
                    if not n:
                        break
                    filled += n
                if filled == size and zr.read(1):
                    filled += 1  # more plaintext than the manifest says
        except zstandard.ZstdError as exc:
            raise ImageCorrupt(
                f"chunk {address} does not decompress: {exc}", chunk=address
            ) from exc
        plain = view[:filled] if filled <= size else view[:size]
        if filled != size:
            raise ImageCorrupt(
                f"chunk {address} decodes to {'more' if filled > size else filled} bytes, "
                f"manifest says {size}",
                chunk=address,
            )
        self._verify(plain, address, size)
        return plain


def _check_declared(frame: bytes | memoryview, address: str, size: int) -> None:
    """:class:`ImageCorrupt` when the frame's header declares another content size than the
    manifest's ``size`` (undeclared is fine: decoding is then bounded by ``size``). Raises
    ``zstandard.ZstdError`` for a header that is not zstd's."""
    declared = zstandard.frame_content_size(frame)
    if declared not in (-1, size):
        raise ImageCorrupt(
            f"chunk {address} has {declared} bytes, manifest says {size}", chunk=address
        )


def check_cipher(encrypted_key_id: str | None, cipher: Cipher | None, image: str) -> None:
    """Refuse early and clearly when an image needs a key we lack or one we hold is wrong."""
    if encrypted_key_id is None:
        return
    if cipher is None:
        raise DecryptionError(
            f"image {image} is encrypted (key id {encrypted_key_id}); give the key with "
            "--encryption-key-file or SPOTGUARD_ENCRYPTION_KEY"
        )
    if cipher.key_id != encrypted_key_id:
        raise DecryptionError(
            f"wrong encryption key for image {image}: it needs key id {encrypted_key_id}, "
            f"the key given has id {cipher.key_id}"
        )
