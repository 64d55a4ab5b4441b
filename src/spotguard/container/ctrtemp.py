"""The copy of a checkpoint containerd leaves behind after restoring it, and its removal.

To restore a task from a checkpoint image, containerd (1.6 to 2.x: containerd issue #10166)
unpacks the image's CRIU files into a fresh ``ctrd-checkpoint*`` directory under the daemon's
``$XDG_RUNTIME_DIR`` (else its temp dir, ``$TMPDIR`` or ``/tmp``) and never removes it. Every
restore would leave a full copy of the job's memory on the host — for a GPU job tens of GB,
held in RAM where that directory is a tmpfs, and readable later by whoever gets root there.

:func:`removing_leftovers` wraps a ``ctr containers restore`` or a ``docker start
--checkpoint`` (docker's containerd does the same): it lists those directories before, and
after the restore (whether it worked or not) removes the new ones whose files are exactly
those of the checkpoint restored (besides CRIU's own logs) — names and sizes of every file,
and the bytes of its ``inventory.img`` and ``core-*.img`` (registers and times: no two
checkpoints share them). A directory another restore made (a user's, maybe still being read)
never matches and is left alone. A restore killed before its clean-up leaves its copy: the
restore run again takes over the container it made and removes every copy of that checkpoint
(:func:`remove_copies`). No library knows containerd's temp-dir rule; it is read from
the daemons themselves (the environment of every ``containerd`` process here).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import stat
import tarfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from spotguard.container.containerd import CRIU_TAR, MAX_INDEX_BYTES, blob_path

log = logging.getLogger(__name__)

PREFIX = "ctrd-checkpoint"
#: files compared byte for byte (small; unique to one checkpoint)
COMPARED = ("inventory.img", "core-")
#: the most bytes of one compared file read
COMPARED_LIMIT = 1 << 20


def daemon_temp_dirs() -> set[Path]:
    """Where the containerd daemons on this host unpack the checkpoints they restore: each
    one's ``XDG_RUNTIME_DIR``, else ``TMPDIR``, else ``/tmp`` (docker's own containerd among
    them); one whose environment cannot be read (not ours to read) is skipped."""
    found: set[Path] = set()
    for p in psutil.process_iter(["name"]):
        if p.info.get("name") != "containerd":
            continue
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        found.add(Path(env.get("XDG_RUNTIME_DIR") or env.get("TMPDIR") or "/tmp"))
    return found


def _listing(where: set[Path]) -> set[Path]:
    """The ``ctrd-checkpoint*`` directories in ``where``."""
    found: set[Path] = set()
    for w in where:
        with contextlib.suppress(OSError):
            found |= {
                Path(e.path)
                for e in os.scandir(w)
                if e.name.startswith(PREFIX) and e.is_dir(follow_symlinks=False)
            }
    return found


@dataclass(frozen=True)
class CriuFiles:
    """A checkpoint's CRIU files as :func:`removing_leftovers` recognises them: every
    file's size by its path, and the bytes of the compared ones."""

    sizes: dict[str, int]
    small: dict[str, bytes]

    @classmethod
    def of_dir(cls, d: Path) -> CriuFiles:
        """The files of a directory of CRIU images (docker's checkpoint)."""
        sizes = _sizes(d)
        small = {p: (d / p).read_bytes() for p, n in sizes.items() if _small(p, n)}
        return cls(sizes, small)

    @classmethod
    def of_layout(cls, layout: Path) -> CriuFiles | None:
        """The CRIU files of a containerd checkpoint layout (``export_layout``'s); None when
        it cannot be read so."""
        try:
            with tarfile.open(layout, "r:") as outer:

                def blob(digest: str) -> IO[bytes]:
                    return _file(outer.extractfile(blob_path(digest)))

                top = json.loads(_file(outer.extractfile("index.json")).read(MAX_INDEX_BYTES))
                index = json.loads(blob(top["manifests"][0]["digest"]).read(MAX_INDEX_BYTES))
                criu = next(d for d in index["manifests"] if d["mediaType"] == CRIU_TAR)
                with tarfile.open(fileobj=blob(criu["digest"]), mode="r:") as inner:
                    return cls._of_members(inner, "")
        except (
            tarfile.TarError,
            OSError,
            ValueError,
            KeyError,
            IndexError,
            TypeError,
            StopIteration,
        ):
            return None

    @classmethod
    def of_tar(cls, archive: Path, under: str) -> CriuFiles | None:
        """The CRIU files under directory ``under`` of a tar (docker's container archive);
        None when it cannot be read so."""
        try:
            with tarfile.open(archive, "r:*") as tar:
                return cls._of_members(tar, os.path.normpath(under) + os.sep)
        except (tarfile.TarError, OSError, KeyError):
            return None

    @classmethod
    def _of_members(cls, tar: tarfile.TarFile, under: str) -> CriuFiles:
        """The regular files of ``tar`` whose path starts with ``under``, by their path
        after it; KeyError for a member that cannot be read."""
        sizes: dict[str, int] = {}
        small: dict[str, bytes] = {}
        for m in tar:
            path = os.path.normpath(m.name)
            if not m.isfile() or not path.startswith(under):
                continue
            rel = path[len(under) :]
            sizes[rel] = m.size
            if _small(rel, m.size):
                small[rel] = _file(tar.extractfile(m)).read()
        return cls(sizes, small)

    def matches(self, d: Path) -> bool:
        """Whether directory ``d`` holds exactly these files (see the module doc)."""
        seen = {p: n for p, n in _sizes(d).items() if not _criu_output(p)}
        if seen != self.sizes:
            return False
        return all((d / path).read_bytes() == data for path, data in self.small.items())


def _criu_output(path: str) -> bool:
    """What a restore may add beside the images (CRIU's log and statistics, where a
    runtime points its work dir there): not part of the comparison."""
    name = os.path.basename(path)
    return name.endswith(".log") or name.startswith("stats-")


def _small(path: str, size: int) -> bool:
    name = os.path.basename(path)
    compared = name == COMPARED[0] or (name.startswith(COMPARED[1]) and name.endswith(".img"))
    return compared and size <= COMPARED_LIMIT


def _sizes(d: Path) -> dict[str, int]:
    """Every regular file under ``d``: its size by its path relative to ``d``."""
    seen: dict[str, int] = {}
    for root, _dirs, files in os.walk(d):
        for name in files:
            st = (Path(root) / name).lstat()
            if stat.S_ISREG(st.st_mode):
                seen[os.path.normpath((Path(root) / name).relative_to(d))] = st.st_size
    return seen


def _file(f: IO[bytes] | None) -> IO[bytes]:
    if f is None:
        raise KeyError("not a regular file")
    return f


def _remove_ours(
    where: set[Path], before: set[Path], files: Callable[[], CriuFiles | None]
) -> list[Path]:
    new = sorted(_listing(where) - before)
    if not new:
        return []
    try:
        criu = files()
    except OSError:
        criu = None
    if criu is None:
        log.warning(
            "containerd's copy of a restored checkpoint kept: the checkpoint is unreadable",
            extra={"path": str(new[0])},
        )
        return []
    removed = []
    for d in new:
        try:
            if criu.matches(d):
                shutil.rmtree(d)
                removed.append(d)
                log.info(
                    "containerd's copy of the restored checkpoint removed", extra={"path": str(d)}
                )
        except OSError as exc:
            log.warning(
                "containerd's copy of the restored checkpoint not removed",
                extra={"path": str(d), "error": str(exc)},
            )
    return removed


@contextlib.asynccontextmanager
async def removing_leftovers(files: Callable[[], CriuFiles | None]) -> AsyncIterator[None]:
    """Around a restore from a checkpoint by containerd (``ctr containers restore``,
    ``docker start --checkpoint``): afterwards, worked or not, the directory containerd
    unpacked it into is removed — the new one holding exactly ``files()`` (read only when
    there is a new one), never one another restore made. Never raises for the clean-up."""
    where = await asyncio.to_thread(daemon_temp_dirs)
    before = await asyncio.to_thread(_listing, where)
    try:
        yield
    finally:
        await asyncio.to_thread(_remove_ours, where, before, files)


async def remove_copies(files: Callable[[], CriuFiles | None]) -> list[Path]:
    """Every copy of the checkpoint ``files()`` in the containerd daemons' directories, for a
    restore that takes over a container an earlier, killed restore made: that one was killed
    before it removed its copy, and the container it made runs (nothing reads the copy)."""
    where = await asyncio.to_thread(daemon_temp_dirs)
    return await asyncio.to_thread(_remove_ours, where, set(), files)
