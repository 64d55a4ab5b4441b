"""Checkpoint images: chunked, zstd-compressed, verified, optionally encrypted, and moved to
and from object stores in parallel. The format is described in docs/image-format.md.

Writing (manifest last; an exception inside the block writes none)::

    async with ImageWriter("s3://bucket/images", "train-1", settings=s) as w:
        await w.add_file("/staging/pages-1.img", "pages-1.img")
        manifest = await w.commit({"timeline": [...]})

Reading (verified bytes only)::

    async with ImageReader("s3://bucket/images/train-1/images/latest", settings=s) as r:
        async for data in r.iter_file("pages-1.img"): ...

Whole directories: :func:`push_dir` / :func:`pull_dir` (:func:`pull_image` for the stats).

Every function and class takes the :class:`ImageSettings` the caller loaded at its edge; the
keys in them (:class:`ImageKeys`: encryption, signing, trusted public keys) decide what is
written and what is accepted (docs/security.md).
"""

from __future__ import annotations

from spotguard.image.catalog import GcResult, ImageInfo, gc, latest_image, list_images, verify_image
from spotguard.image.codec import ChunkCodec, Cipher, generate_key, load_key
from spotguard.image.keys import ImageKeys, generate_signing_key
from spotguard.image.manifest import FORMAT, ChunkRef, FileEntry, ImageRef, Manifest, Signature
from spotguard.image.reader import ImageReader, VerifyReport
from spotguard.image.settings import ImageSettings
from spotguard.image.stats import ProgressFn, TransferStats
from spotguard.image.transfer import PullResult, PushResult, pull_dir, pull_image, push_dir
from spotguard.image.writer import FileSink, ImageWriter

__all__ = [
    "FORMAT",
    "ChunkCodec",
    "ChunkRef",
    "Cipher",
    "FileEntry",
    "FileSink",
    "GcResult",
    "ImageInfo",
    "ImageKeys",
    "ImageReader",
    "ImageRef",
    "ImageSettings",
    "ImageWriter",
    "Manifest",
    "ProgressFn",
    "PullResult",
    "PushResult",
    "Signature",
    "TransferStats",
    "VerifyReport",
    "gc",
    "generate_key",
    "generate_signing_key",
    "latest_image",
    "list_images",
    "load_key",
    "pull_dir",
    "pull_image",
    "push_dir",
    "verify_image",
]
