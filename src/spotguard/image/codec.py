"""Chunk encoding: address, compress, encrypt — and the reverse with verification.

A chunk's **address** (its ``sha256`` in the manifest and its store key) is computed over the
chunk's *plaintext*:

* without encryption: ``sha256(plaintext)``;
* with encryption: ``HMAC-SHA256(k_addr, plaintext)``, so the store never learns plaintext
  hashes (which would let anyone confirm a guess of a chunk's content).

The **stored object** is one independent zstd frame of the plaintext (content size in the
frame header); with encryption it is ``b"SGE1" || nonce || AES-256-GCM(frame)`` where the nonce
is ``HMAC-SHA256(k_nonce, address)[:12]`` and the address is the associated data.

Why plaintext addressing: an unchanged chunk is recognised *before* it is compressed, so a
periodic checkpoint of a job whose memory barely changed costs one hash per chunk, not a
compression; and the address does not change when the zstd level or library changes.
Verification decodes the stored bytes and re-computes the address: a flipped bit anywhere
(ciphertext, frame or content) is caught. With encryption the GCM tag catches it first.

The nonce is deterministic — the price of dedup under encryption: equal plaintext chunks give
equal stored objects (an observer learns that two chunks are equal, nothing more). Distinct
plaintexts get distinct nonces, as the address is collision-resistant, so GCM's "never reuse a
nonce with different data" holds. Subkeys come from the master key by HKDF-SHA256.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import zstandard

from spotguard.errors import ConfigError, DecryptionError, ImageCorrupt

ENC_MAGIC = b"SGE1"
ENC_ALG = "AES-256-GCM"
KEY_BYTES = 32
NONCE_BYTES = 12

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

    @classmethod
    def from_key(cls, key: bytes) -> Cipher:
        if len(key) != KEY_BYTES:
            raise ConfigError(f"encryption key must be {KEY_BYTES} bytes, got {len(key)}")
        return cls(
            key_id=_hkdf(key, b"key-id")[:8].hex(),
            addr_key=_hkdf(key, b"address"),
            nonce_key=_hkdf(key, b"nonce"),
            enc_key=_hkdf(key, b"encrypt"),
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


class ChunkCodec:
    """Turns plaintext chunks into stored objects and back. Thread-safe (per-thread zstd
    contexts); every method is CPU-bound and meant to run in a worker thread (hashlib, zstd
    and AES-GCM release the GIL on large buffers)."""

    def __init__(self, level: int = 1, cipher: Cipher | None = None) -> None:
        self.level = level
        self.cipher = cipher

    def address(self, plain: bytes | memoryview) -> str:
        if self.cipher is None:
            return hashlib.sha256(plain).hexdigest()
        return hmac.new(self.cipher.addr_key, plain, hashlib.sha256).hexdigest()

    def encode(self, plain: bytes | memoryview, address: str) -> bytes:
        frame = _compressor(self.level).compress(plain)
        if self.cipher is None:
            return frame
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        nonce = hmac.new(self.cipher.nonce_key, address.encode(), hashlib.sha256).digest()
        nonce = nonce[:NONCE_BYTES]
        sealed = AESGCM(self.cipher.enc_key).encrypt(nonce, frame, address.encode())
        return ENC_MAGIC + nonce + sealed

    def decode(self, stored: bytes, address: str, size: int) -> bytes:
        """The verified plaintext of a stored chunk.

        Raises :class:`ImageCorrupt` (naming the chunk) when the bytes do not decode to a
        plaintext of ``size`` bytes whose address is ``address``.
        """
        frame: bytes = stored
        if self.cipher is not None:
            if not stored.startswith(ENC_MAGIC) or len(stored) < 4 + NONCE_BYTES + 16:
                raise ImageCorrupt(f"chunk {address} is not an encrypted chunk", chunk=address)
            from cryptography.exceptions import InvalidTag
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            nonce = stored[4 : 4 + NONCE_BYTES]
            try:
                frame = AESGCM(self.cipher.enc_key).decrypt(
                    nonce, stored[4 + NONCE_BYTES :], address.encode()
                )
            except InvalidTag as exc:
                raise ImageCorrupt(
                    f"chunk {address} failed authentication (corrupt)", chunk=address
                ) from exc
        try:
            plain = _decompressor().decompress(frame, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise ImageCorrupt(
                f"chunk {address} does not decompress: {exc}", chunk=address
            ) from exc
        if len(plain) != size:
            raise ImageCorrupt(
                f"chunk {address} has {len(plain)} bytes, manifest says {size}", chunk=address
            )
        if not hmac.compare_digest(self.address(plain), address):
            raise ImageCorrupt(f"chunk {address} fails its hash check", chunk=address)
        return plain


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
