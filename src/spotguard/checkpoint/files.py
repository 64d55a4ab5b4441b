"""The job's files that travel inside an image, and the rules for putting them back.

CRIU records the size of every regular file a process holds open and refuses to restore
when the file on disk differs (``File ... has bad size``). A job's log keeps growing after a
leave-running dump, and on a new machine it does not exist at all. So an image carries, under
``files/`` (mirroring absolute paths), a snapshot taken while the tree is frozen of

* every regular file in the job's directory (job.json, stdout, stderr, ...), and
* every other regular file the job holds open for writing (recorded as such),

and restore puts them back at their paths before ``criu restore``. Files the job only reads
must be the same on the restoring machine (see docs/limits.md).

Restore runs as root, so what it writes is limited to what the job owns (docs/security.md);
:func:`put_back` checks every entry first and refuses the whole image
(:class:`~spotguard.errors.UnsafeCarriedFile`) before writing a byte when one breaks a rule:

* a path is absolute and normalized (no ``..``, ``.``, ``//``, NUL);
* it lies in the job's directory, or the job held it open for writing at the dump;
* the job's directory is ``…/jobs/<job>`` for this job: the one this host's state dir gives it
  (``<state_dir>/jobs/<job>``), or the dumping host's one when state dirs differ (CRIU reopens
  files by absolute path), never an arbitrary directory;
* no symlink on the way: nothing under the job directory, and no directory of an open file's
  path, may be a symlink (it would redirect the write);
* permission bits only: a mode with setuid, setgid, sticky or file-type bits is refused (capture
  never records them); owner and group are restored only for files that pass these rules;
* ``open_for_writing`` is the image's own claim: only an authenticated image (the fleet's keys,
  or this host's seal of a local image) may put a file outside the job's directory.

The writes themselves never go by path: each file's directory is reached by a walk of
directory fds opened ``O_NOFOLLOW|O_DIRECTORY`` (from the ``jobs`` directory for the job's
files, from ``/`` for the others), and the file is opened relative to it, so a directory
swapped for a symlink while restore runs cannot redirect a root write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from spotguard import safefs
from spotguard.errors import CheckpointError, ImageError, UnsafeCarriedFile, UnsafePath
from spotguard.names import check_job_name

log = logging.getLogger(__name__)

FILES_DIR = "files"
#: never carried: engine bookkeeping that must not come back with an old image
SKIP_NAMES = frozenset({"operation.json"})
PERMISSION_BITS = 0o777


@dataclass(frozen=True)
class CapturedFile:
    """One file carried in an image: where it goes, its size, permission bits and owner at
    the dump, and whether the job held it open for writing then."""

    path: str
    size: int
    mode: int
    open_for_writing: bool = False
    uid: int | None = None
    gid: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> CapturedFile:
        """Parse one entry of the image metadata; a malformed one is an :class:`ImageError`."""
        if not isinstance(d, dict) or set(d) - set(cls.__dataclass_fields__):
            raise ImageError(f"carried file entry {d!r} is malformed")
        path, size, mode = d.get("path"), d.get("size"), d.get("mode")
        ids = [d.get("uid"), d.get("gid")]
        if (
            not isinstance(path, str)
            or not _is_int(size)
            or not _is_int(mode)
            or not isinstance(d.get("open_for_writing", False), bool)
            or not all(i is None or _is_int(i) for i in ids)
        ):
            raise ImageError(f"carried file entry {d!r} is malformed")
        assert isinstance(size, int) and isinstance(mode, int)
        return cls(path, size, mode, bool(d.get("open_for_writing")), ids[0], ids[1])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class Candidate(NamedTuple):
    """A file to carry, and whether the job holds it open for writing."""

    path: Path
    open_for_writing: bool


def _stored(images_dir: Path, path: str) -> Path:
    return images_dir / FILES_DIR / path.lstrip("/")


def candidates(job_dir: Path, open_for_writing: Iterable[Path]) -> list[Candidate]:
    """The files to carry: the job directory's regular files and the writable open files."""
    found: set[Path] = set()
    if job_dir.is_dir():
        for root, _dirs, names in os.walk(job_dir):
            for n in names:
                p = Path(root) / n
                if n not in SKIP_NAMES and not n.startswith(".") and p.is_file():
                    found.add(p.absolute())
    writing = {p.absolute() for p in open_for_writing}
    return [Candidate(p, p in writing) for p in sorted(found | writing)]


def capture(
    paths: Iterable[Candidate | Path], images_dir: Path, max_bytes: int
) -> list[CapturedFile]:
    """Copy ``paths`` into ``images_dir/files/`` (must run while the job is frozen); records
    permission bits only (never setuid/setgid) and the owner."""
    out: list[CapturedFile] = []
    total = 0
    for item in paths:
        p, writing = item if isinstance(item, Candidate) else (item, False)
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
        mode = st.st_mode & PERMISSION_BITS
        out.append(CapturedFile(str(p), st.st_size, mode, writing, st.st_uid, st.st_gid))
    return out


def _refuse(e: CapturedFile, why: str) -> UnsafeCarriedFile:
    log.warning("carried file refused", extra={"path": e.path, "error": why})
    return UnsafeCarriedFile(f"image refused: carried file {e.path!r} {why}")


def _mode_problem(mode: int) -> str | None:
    if mode & ~0o7777:
        return "file-type"
    for bit, name in ((stat.S_ISUID, "setuid"), (stat.S_ISGID, "setgid"), (stat.S_ISVTX, "sticky")):
        if mode & bit:
            return name
    return None


def _symlink_between(top: Path, dest: Path) -> Path | None:
    """The first existing symlink among the directories from ``top`` (excluded) to ``dest``'s
    parent (included), if any."""
    for d in reversed(dest.parents):
        if top in d.parents and d.is_symlink():
            return d
    return None


def check_job_dir(image_job_dir: Path, job_dir: Path) -> None:
    """Refuse a job directory that is not ``…/jobs/<job>`` for this job (see module doc)."""
    name = job_dir.name
    try:
        check_job_name(name)
    except ValueError as exc:
        raise UnsafeCarriedFile(f"image refused: {exc}") from exc
    d = str(image_job_dir)
    shaped = image_job_dir.name == name and image_job_dir.parent.name == "jobs"
    if not (image_job_dir.is_absolute() and os.path.normpath(d) == d and shaped):
        raise UnsafeCarriedFile(
            f"image refused: its job directory {d!r} is not a job directory of job {name!r} "
            f"(an absolute …/jobs/{name}); this host's is {job_dir}"
        )
    if image_job_dir != job_dir:
        if os.path.realpath(d) != d:
            raise UnsafeCarriedFile(
                f"image refused: its job directory {d} goes through a symlink on this host"
            )
        log.warning(
            "the image's job directory (dir) differs from this host's (path): state_dir "
            "differs; the job's files go where CRIU reopens them",
            extra={"dir": d, "path": str(job_dir)},
        )


def plan(
    entries: Iterable[CapturedFile],
    image_job_dir: Path,
    job_dir: Path,
    *,
    authenticated: bool = False,
) -> list[Path]:
    """The destination of every entry, or :class:`UnsafeCarriedFile` for the first that breaks
    a rule (see the module doc). Touches nothing. ``open_for_writing`` is a claim of the
    image: honoured only when the image is ``authenticated``."""
    check_job_dir(image_job_dir, job_dir)
    out: list[Path] = []
    for e in entries:
        p = e.path
        if "\0" in p:
            raise _refuse(e, "contains a NUL byte")
        if not p.startswith("/") or os.path.normpath(p) != p or "//" in p:
            raise _refuse(e, "is not a normalized absolute path (no '..', '.' or '//')")
        bad = _mode_problem(e.mode)
        if bad is not None:
            raise _refuse(e, f"has mode {e.mode:o} with {bad} bits: only permission bits")
        dest = Path(p)
        in_job = image_job_dir in dest.parents
        if not in_job and not e.open_for_writing:
            raise _refuse(
                e,
                f"is outside the job directory {image_job_dir} and not a file the job held "
                "open for writing at the dump",
            )
        if not in_job and not authenticated:
            raise _refuse(
                e,
                f"is outside the job directory {image_job_dir}, and the image is not "
                "authenticated (no key on this host): only an authenticated image may put "
                "back the files its job held open for writing elsewhere",
            )
        top = image_job_dir if in_job else Path("/")
        link = _symlink_between(top, dest)
        if link is not None:
            raise _refuse(e, f"would be written through the symlink {link}")
        if dest.is_dir() and not dest.is_symlink():
            raise _refuse(e, "is a directory on this host")
        out.append(dest)
    return out


def _walk_to(top: Path, rel: list[str], first_mode: int) -> int:
    """An fd of the directory ``top``/``rel``, every component of ``rel`` opened relative to
    its parent with ``O_NOFOLLOW|O_DIRECTORY`` (created where missing: ``first_mode`` for the
    first, 0755 below); ``top`` itself is opened the same way from ``/``. A directory
    swapped for a symlink at any moment — before or during the restore — makes the walk
    fail: it can never lead a root write elsewhere (no check by path, then write by path)."""
    fd = safefs.open_dir_nofollow(top)
    try:
        for i, name in enumerate(rel):
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, first_mode if i == 0 else 0o755, dir_fd=fd)
            nxt = safefs.open_subdir(fd, name, str(top.joinpath(*rel[: i + 1])))
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _in_place(dfd: int, name: str) -> int | None:
    """An fd for rewriting ``name`` (in the directory ``dfd``) in place — a regular file with
    one link, opened without following a link — or None (then a fresh file replaces it).

    Rewriting in place keeps the file's inode: a job restored on the node it left (unpark,
    a periodic image restored) finds the very files it had open. SQLite, for one, compares
    the inode of its open database with the path's and turns read-only ("attempt to write a
    readonly database") when they differ. A file with other links is never written through.
    """
    try:
        fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        return None
    return fd


def _fill(fd: int, src: Path, e: CapturedFile) -> None:
    with src.open("rb") as f, os.fdopen(fd, "wb", closefd=False) as out:
        shutil.copyfileobj(f, out, 1 << 20)
    os.fchmod(fd, e.mode & PERMISSION_BITS)
    if os.geteuid() == 0 and e.uid is not None and e.gid is not None:
        os.fchown(fd, e.uid, e.gid)


def _write(src: Path, top: Path, rel: list[str], e: CapturedFile, first_mode: int) -> int:
    """Copy ``src`` to ``top``/``rel`` — in place when it is an existing regular file
    of one link (:func:`_in_place`), else through a fresh temporary file of a random name
    (``O_EXCL|O_NOFOLLOW``) renamed over it — all relative to the fd of its directory
    (:func:`_walk_to`), with the entry's permission bits and, as root, its owner. Returns the
    size written."""
    name = rel[-1]
    dfd = _walk_to(top, rel[:-1], first_mode)
    try:
        fd = _in_place(dfd, name)
        if fd is not None:
            try:
                os.ftruncate(fd, 0)
                _fill(fd, src, e)
                return os.fstat(fd).st_size
            finally:
                os.close(fd)
        tmp = f".{name}.{secrets.token_hex(6)}.spotguard-tmp"
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dfd,
        )
        try:
            _fill(fd, src, e)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        return size
    finally:
        os.close(dfd)


def put_back(
    entries: Iterable[CapturedFile],
    images_dir: Path,
    *,
    image_job_dir: Path,
    job_dir: Path,
    authenticated: bool = False,
) -> list[Path]:
    """Write the carried files back to their paths (before ``criu restore``), after checking
    every one against the rules (module doc). ``image_job_dir`` is the job directory the
    image records, ``job_dir`` this host's (``<state_dir>/jobs/<job>``). ``authenticated``:
    the image was authenticated (a fleet key, or this host's seal for a local image); an
    unauthenticated one may write only in the job's directory. Returns the paths written."""
    items = list(entries)
    dests = plan(items, image_job_dir, job_dir, authenticated=authenticated)
    for e, dest in zip(items, dests, strict=True):
        src = _stored(images_dir, e.path)
        if image_job_dir in dest.parents:  # from the (real) jobs directory: the job's own
            top, first = Path(os.path.realpath(image_job_dir.parent)), safefs.PRIVATE_DIR
            rel = list(dest.relative_to(image_job_dir.parent).parts)
        else:  # every component from / without following a link
            top, first, rel = Path("/"), 0o755, list(dest.parts[1:])
        try:
            if not src.is_file() or src.is_symlink():
                raise CheckpointError(f"the image holds no file for {dest}")
            size = _write(src, top, rel, e, first)
        except UnsafePath as exc:
            raise _refuse(e, f"would be written through a symlink ({exc})") from exc
        except OSError as exc:
            raise CheckpointError(f"cannot restore {dest} from the image: {exc}") from exc
        if size != e.size:
            raise CheckpointError(f"{dest}: image holds {e.size} bytes, wrote another size")
    return dests
