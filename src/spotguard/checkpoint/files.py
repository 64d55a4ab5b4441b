"""The job's files that travel inside an image.

CRIU records the size of every regular file a process holds open and refuses to restore
when the file on disk differs (``File ... has bad size``). A job's log keeps growing after a
leave-running dump, and on a new machine it does not exist at all. So an image carries, under
``files/`` (mirroring absolute paths), a snapshot taken while the tree is frozen of

* every regular file in the job's directory (job.json, stdout, stderr, ...), and
* every other regular file the job holds open for writing,

and restore puts them back at their paths before ``criu restore``. Files the job only reads
must be the same on the restoring machine (see docs/limits.md).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spotguard.errors import CheckpointError

FILES_DIR = "files"
#: never carried: engine bookkeeping that must not come back with an old image
SKIP_NAMES = frozenset({"operation.json"})


@dataclass(frozen=True)
class CapturedFile:
    """One file carried in an image: where it goes, its size and mode at the dump."""

    path: str
    size: int
    mode: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _stored(images_dir: Path, path: str) -> Path:
    return images_dir / FILES_DIR / path.lstrip("/")


def candidates(job_dir: Path, open_for_writing: Iterable[Path]) -> list[Path]:
    """The files to carry: the job directory's regular files and the writable open files."""
    found: set[Path] = set()
    if job_dir.is_dir():
        for root, _dirs, names in os.walk(job_dir):
            for n in names:
                p = Path(root) / n
                if n not in SKIP_NAMES and not n.startswith(".") and p.is_file():
                    found.add(p.absolute())
    found.update(p.absolute() for p in open_for_writing)
    return sorted(found)


def capture(paths: Iterable[Path], images_dir: Path, max_bytes: int) -> list[CapturedFile]:
    """Copy ``paths`` into ``images_dir/files/`` (must run while the job is frozen)."""
    out: list[CapturedFile] = []
    total = 0
    for p in paths:
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        total += st.st_size
        if total > max_bytes:
            raise CheckpointError(
                f"the job's open files exceed max_file_bytes ({max_bytes} bytes) at {p}; "
                "raise the setting or keep large outputs outside the job (docs/limits.md)"
            )
        dest = _stored(images_dir, str(p))
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(p, dest)
        except OSError as exc:
            raise CheckpointError(f"cannot copy {p} into the image: {exc}") from exc
        out.append(CapturedFile(str(p), st.st_size, st.st_mode & 0o7777))
    return out


def put_back(entries: Iterable[CapturedFile], images_dir: Path) -> None:
    """Write the carried files back to their paths (before ``criu restore``)."""
    for e in entries:
        src = _stored(images_dir, e.path)
        dest = Path(e.path)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.spotguard-tmp")
            shutil.copyfile(src, tmp)
            os.chmod(tmp, e.mode)
            os.replace(tmp, dest)
        except OSError as exc:
            raise CheckpointError(f"cannot restore {dest} from the image: {exc}") from exc
        if dest.stat().st_size != e.size:
            raise CheckpointError(f"{dest}: image holds {e.size} bytes, wrote another size")
