"""Settings of the image format and transfers (config section ``[image]``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, SecretStr

from spotguard.config import Settings

DEFAULT_CHUNK_SIZE = 64 << 20


class ImageSettings(Settings):
    """How images are cut, compressed, encrypted and moved.

    ``encryption_key`` and ``signing_key`` are read from ``SPOTGUARD_ENCRYPTION_KEY`` /
    ``SPOTGUARD_SIGNING_KEY`` (or the config file) and are deliberately not command-line flags:
    flags show up in ``ps``. Use the ``*_file`` settings on the command line. Which keys mean
    what: :mod:`spotguard.image.keys` and docs/security.md.
    """

    section: ClassVar[str] = "image"

    chunk_size: int = Field(
        DEFAULT_CHUNK_SIZE,
        ge=64 << 10,
        le=1 << 30,
        description="Bytes per chunk before compression (each chunk is one zstd frame)",
    )
    level: int = Field(1, ge=-7, le=22, description="zstd compression level")
    workers: int = Field(
        0, ge=0, description="Threads that hash/compress/decompress chunks (0 = one per CPU)"
    )
    io_workers: int = Field(16, ge=1, le=256, description="Parallel store requests")
    pipe_mb: int = Field(
        64,
        ge=1,
        le=1024,
        description="Size of each pipe CRIU streams an image through (MiB); fs.pipe-max-size "
        "is raised to it when lower (root), else pipes stay at that limit",
    )
    sparse_restore: bool = Field(
        True,
        description="A streamed restore leaves all-zero chunks of private anonymous memory "
        "out of the pages CRIU writes (untouched, they read zero)",
    )
    max_inflight_mb: int = Field(
        1024, ge=1, description="Memory bound for chunks in flight (MiB); writers wait beyond it"
    )
    retries: int = Field(5, ge=1, le=50, description="Attempts per store request on 5xx/drops")
    store_timeout: float = Field(
        30.0,
        gt=0,
        le=600,
        description="Seconds a store request may wait to connect or for the next byte of an "
        "answer before it is retried (a store that hangs)",
    )
    dedup: bool = Field(True, description="Skip chunks already in the store")
    encryption_key_file: Path | None = Field(
        None, description="File with a 32-byte key (raw, hex or base64) for AES-256-GCM"
    )
    encryption_key: SecretStr | None = Field(
        None, description="AES-256-GCM key as hex or base64 (prefer the file or env var)"
    )
    signing_key_file: Path | None = Field(
        None,
        description="Ed25519 private key (PEM, OpenSSH or 32-byte seed) that signs manifests",
    )
    signing_key: SecretStr | None = Field(
        None, description="Ed25519 private key text (prefer the file; never a flag)"
    )
    verify_key_file: Path | None = Field(
        None,
        description="Ed25519 public key(s) (PEM, ssh-ed25519 or hex/base64, one per line); "
        "when set, only images signed by one of them are read",
    )
    verify_key: str = Field(
        "", description="Ed25519 public key(s) inline, comma-separated (as verify_key_file)"
    )
    allow_rollback: bool = Field(
        False,
        description="Read an authenticated image although the job has a newer one (on purpose)",
    )
    raw_saving: float = Field(
        0.03,
        ge=0.0,
        le=1.0,
        description="Store a chunk as a raw frame unless a sample of it compresses by at least "
        "this fraction (0 = always compress)",
    )
    gpu_raw_saving: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="raw_saving for the GPU memory carried beside CRIU's files: bf16 weights "
        "pack by ~22 % at ~0.33 GB/s per thread, which made a 40 GiB image's stream 3.6x "
        "slower; lower it where the store's bandwidth, not the CPU, bounds a checkpoint",
    )
    sse: Literal["", "AES256", "aws:kms"] = Field(
        "", description="S3 server-side encryption (AES256 or aws:kms)"
    )
    sse_kms_key_id: str = Field("", description="KMS key id for sse=aws:kms")
    gc_grace_s: float = Field(
        3600.0, ge=0, description="gc keeps unreferenced chunks younger than this (seconds)"
    )

    def cpu_workers(self) -> int:
        return self.workers or (os.cpu_count() or 2)

    def max_inflight_chunks(self) -> int:
        """Chunks that may be in flight at once: by the memory bound, at least 2."""
        return max(2, (self.max_inflight_mb << 20) // self.chunk_size)
