"""The seal of a local image: images parked, staged or kept on this host are authenticated
like the store's, under a key only this host's root holds.

A store image is authenticated by its manifest's signature or MAC (:mod:`spotguard.image.keys`).
A local image — a park to tmpfs or disk, a staging directory before its push, an exit image
kept until durable — is a directory of CRIU's files that restore runs as root; before this
seal anyone able to write it chose the restored process state and the files put back (and a
staged image tampered with before its push got signed by the fleet's key). So
:meth:`DirectoryTarget.finish <spotguard.checkpoint.staging.DirectoryTarget.finish>` writes
``spotguard-seal.json``: every file's name, size and BLAKE3 hash, and a keyed BLAKE3 MAC over
that list under the **host key**; :func:`verify` checks the MAC, then that the directory holds
exactly those files (nothing unrecorded: a planted file or directory refuses the image) and
that every file hashes as sealed — before restore reads a byte of it, and before a staged or
kept image is pushed (and signed with the fleet's key).

The host key is 32 random bytes in ``<state_dir>/keys/host-image.key`` (0600, in a 0700
directory, owned by root), created at first use. It never leaves the host: a local image is
only ever restored where it was made (one moved to another host by hand is refused; push it
to a store instead).

Cost: BLAKE3 over the image once at seal and once at verify (about 1.6 GiB/s per core,
multi-threaded; docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import logging
import mmap
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from spotguard import safefs
from spotguard.errors import BadSignature, UnsafePath, UnsignedImage
from spotguard.statedir import StateDir

from .settings import DEFAULT_STATE_DIR

log = logging.getLogger(__name__)

SEAL_NAME = "spotguard-seal.json"
KEY_BYTES = 32
SEAL_VERSION = 1
#: written into an image directory after its seal, never read by a restore: CRIU's logs and
#: statistics (an exit-mode image is sealed while CRIU still runs, before it stops the job;
#: a restore attempt leaves its own beside the images for whoever debugs it)
AFTER_SEAL = frozenset(
    {SEAL_NAME, "criu-dump.log", "stats-dump", "criu-restore.log", "stats-restore"}
)
_MAX_SEAL_BYTES = 64 << 20
_MAX_FILES = 1_000_000


@dataclass(frozen=True)
class HostKey:
    """Where this host's image key lives (it is read, or created, at first use)."""

    path: Path

    @classmethod
    def for_state(cls, state_dir: Path) -> HostKey:
        return cls(StateDir(state_dir).host_key)

    @classmethod
    def default(cls) -> HostKey:
        return cls.for_state(DEFAULT_STATE_DIR)

    def load(self) -> bytes:
        """The key: read from its file (which must be ours, 0600, a regular file, 32 bytes),
        or created there (atomically: a fresh file linked into place) when absent."""
        with safefs.opened_private_dir(self.path.parent) as dfd:
            for _ in range(50):
                try:
                    return self._read(dfd)
                except FileNotFoundError:
                    self._create(dfd)
            raise UnsafePath(f"{self.path} could not be read or created")

    def _read(self, dfd: int) -> bytes:
        fd = os.open(self.path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            st = os.fstat(fd)
            ok = stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
            if not ok or stat.S_IMODE(st.st_mode) & 0o077 or st.st_size != KEY_BYTES:
                raise UnsafePath(
                    f"host image key {self.path} is not a {KEY_BYTES}-byte file private to "
                    "root (mode 0600); remove it and a new one is made (local images sealed "
                    "under it are then refused)"
                )
            key = os.read(fd, KEY_BYTES + 1)
        finally:
            os.close(fd)
        if len(key) != KEY_BYTES:
            raise UnsafePath(f"host image key {self.path} is truncated")
        return key

    def _create(self, dfd: int) -> None:
        tmp = f".{self.path.name}.{secrets.token_hex(6)}"
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dfd,
        )
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, self.path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            log.info("created the host image key", extra={"path": str(self.path)})
        except FileExistsError:
            pass  # another process made it first: use theirs
        finally:
            os.unlink(tmp, dir_fd=dfd)


def _key_id(key: bytes) -> str:
    return blake3.blake3(b"spotguard host image key id", key=key).hexdigest()[:16]


def _hash_at(dfd: int, name: str, where: str) -> tuple[int, str]:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadSignature(f"local image {where} holds a symlink: refused") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadSignature(f"local image {where} holds a special file: refused")
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        if st.st_size:
            with mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ) as m:
                h.update(m)
        return st.st_size, h.hexdigest()
    finally:
        os.close(fd)


def _walk(dfd: int, prefix: str, out: dict[str, tuple[int, int]]) -> None:
    """Every regular file below ``dfd`` (relative name → (dir fd, …) is not kept: names
    only, with their sizes); a symlink or special file refuses the image."""
    with os.scandir(dfd) as it:
        entries = list(it)
    for e in entries:
        rel = f"{prefix}{e.name}"
        if not prefix and e.name in AFTER_SEAL:
            continue
        if e.is_symlink():
            raise BadSignature(f"local image holds a symlink {rel!r}: refused")
        if e.is_dir(follow_symlinks=False):
            sub = os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
            try:
                _walk(sub, rel + "/", out)
            finally:
                os.close(sub)
        elif e.is_file(follow_symlinks=False):
            out[rel] = (e.stat(follow_symlinks=False).st_size, 0)
        else:
            raise BadSignature(f"local image holds a special file {rel!r}: refused")
        if len(out) > _MAX_FILES:
            raise BadSignature(f"local image holds more than {_MAX_FILES} files: refused")


def _hash_all(root: Path, names: list[str]) -> list[list[Any]]:
    out: list[list[Any]] = []
    with safefs.opened_private_dir(root) as rfd:
        for name in names:
            parts = name.split("/")
            dfd = os.dup(rfd)
            try:
                for p in parts[:-1]:
                    nxt = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
                    os.close(dfd)
                    dfd = nxt
                size, digest = _hash_at(dfd, parts[-1], f"{root}/{name}")
            finally:
                os.close(dfd)
            out.append([name, size, digest])
    return out


def _listing(root: Path) -> list[str]:
    found: dict[str, tuple[int, int]] = {}
    with safefs.opened_private_dir(root) as rfd:
        _walk(rfd, "", found)
    return sorted(found)


def _mac(key: bytes, body: dict[str, Any]) -> str:
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return blake3.blake3(data, key=key).hexdigest()


def seal(images_dir: Path, host_key: HostKey) -> None:
    """Seal ``images_dir`` (a complete image) under the host key (module doc)."""
    key = host_key.load()
    body = {
        "seal": SEAL_VERSION,
        "key_id": _key_id(key),
        "files": _hash_all(images_dir, _listing(images_dir)),
    }
    out = {**body, "mac": _mac(key, body)}
    with safefs.opened_private_dir(images_dir) as dfd:
        safefs.write_at(dfd, SEAL_NAME, json.dumps(out).encode())


def _read_seal(images_dir: Path, where: str) -> dict[str, Any]:
    try:
        with safefs.opened_private_dir(images_dir) as dfd:
            data = safefs.read_at(dfd, SEAL_NAME, limit=_MAX_SEAL_BYTES)
    except FileNotFoundError as exc:
        raise UnsignedImage(
            f"local image {where} has no seal ({SEAL_NAME}): not written by this host's "
            "spotguard, or tampered with; refused"
        ) from exc
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadSignature(f"the seal of local image {where} is not JSON: refused") from exc
    if not isinstance(raw, dict) or set(raw) != {"seal", "key_id", "files", "mac"}:
        raise BadSignature(f"the seal of local image {where} is malformed: refused")
    return raw


def verify(images_dir: Path, host_key: HostKey) -> None:
    """Raise :class:`~spotguard.errors.ImageUntrusted` unless ``images_dir`` is exactly as
    sealed under this host's key: MAC, then the file list (nothing more, nothing less), then
    every file's hash. Reads nothing else of the image."""
    where = str(images_dir)
    raw = _read_seal(images_dir, where)
    key = host_key.load()
    body = {k: raw[k] for k in ("seal", "key_id", "files")}
    if raw["key_id"] != _key_id(key):
        raise BadSignature(
            f"local image {where} was sealed under another host key ({raw['key_id']!r}, this "
            f"host's is {_key_id(key)!r}): refused (move images between hosts through a store)"
        )
    if not isinstance(raw["mac"], str) or not hmac.compare_digest(raw["mac"], _mac(key, body)):
        raise BadSignature(f"the seal of local image {where} does not match: altered, refused")
    files = raw["files"]
    sealed = {f[0]: f for f in files}
    present = _listing(images_dir)
    extra = sorted(set(present) - set(sealed))
    missing = sorted(set(sealed) - set(present))
    if extra or missing:
        what = f"unrecorded {extra[:3]}" if extra else f"missing {missing[:3]}"
        raise BadSignature(f"local image {where} differs from its seal ({what}): refused")
    for name, size, digest in _hash_all(images_dir, present):
        s = sealed[name]
        if s[1] != size or not hmac.compare_digest(str(s[2]), digest):
            raise BadSignature(f"local image {where}: {name} was altered after its seal: refused")
    log.debug("local image seal verified", extra={"path": where})


def is_sealed(images_dir: Path, host_key: HostKey) -> bool:
    """True when :func:`verify` accepts ``images_dir`` (for finding images, never raising)."""
    with contextlib.suppress(OSError, BadSignature, UnsignedImage, UnsafePath):
        verify(images_dir, host_key)
        return True
    return False
