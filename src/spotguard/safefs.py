"""Local paths spotguard writes or reads as root, opened so that no other user can redirect them.

spotguard runs as root on hosts where ordinary users (a notebook, the team's other accounts)
run too. Every directory it keeps state in — staging under ``/dev/shm/spotguard``, parked
images, the state directory, a job's directory — could be created first, or swapped for a
symlink, by such a user. So, in one place:

* :func:`private_dir` opens (creating what is missing, mode 0700) a directory spotguard owns
  and returns a file descriptor of it. Every directory on the way is opened relative to its
  parent with ``O_NOFOLLOW|O_DIRECTORY`` (no check-then-use by path) and checked: the
  ancestors must belong to root (or to us) and be writable by nobody else unless sticky
  (``/tmp``, ``/dev/shm``); the directory itself must belong to us and not be a symlink. One
  created first by another user is refused with one line (:class:`~spotguard.errors.UnsafePath`);
  one of ours that is group/world accessible is tightened to 0700.
* :func:`write_file` / :func:`write_at` replace a file atomically through a fresh temporary
  file created ``O_CREAT|O_EXCL|O_NOFOLLOW`` relative to a directory fd, then ``renameat``:
  a link planted at the name, or at a guessable temporary name, is never followed. The file
  and its directory are fsync'd. :func:`write_atomic` is the same for state in a directory
  named by path (the agent's ledger, spool, restore progress, a job's freeze marker).
* :func:`open_dir_nofollow` walks an absolute path component by component with
  ``O_NOFOLLOW``: a directory swapped for a symlink at any moment makes the walk fail
  instead of leading a root write elsewhere.

An ancestor that is itself a symlink owned by root in a root-only directory (``/var/run``) is
resolved once, up front, by :func:`os.path.realpath`; the walk then refuses any link, so a
swap after that resolution fails the walk.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from spotguard.errors import UnsafePath

log = logging.getLogger(__name__)

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _parts(path: Path) -> list[str]:
    p = Path(os.path.abspath(path))
    return [c for c in p.parts[1:] if c]


def open_subdir(parent: int, name: str, where: str) -> int:
    """``name`` in the directory ``parent``, opened ``O_NOFOLLOW|O_DIRECTORY``; a link (or
    anything not a directory) there raises :class:`UnsafePath` naming ``where``."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePath(
                f"{where} is a symlink or not a directory; refusing to use it"
            ) from exc
        raise


def _trusted_ancestor(fd: int, where: str) -> None:
    """An ancestor of a private directory: owned by root or us, writable by nobody else
    unless sticky (then others cannot rename or remove what we put in it)."""
    st = os.fstat(fd)
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafePath(
            f"{where} belongs to uid {st.st_uid}, not root: another user could swap what "
            "spotguard keeps below it; fix its owner or choose another directory"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(
            f"{where} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}) and not "
            "sticky: another user could swap what spotguard keeps below it"
        )


def _owned(fd: int, where: str, mode: int) -> None:
    """The private directory itself: ours, 0700 (tightened when it is ours and wider)."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise UnsafePath(
            f"{where} belongs to uid {st.st_uid}, not to spotguard (uid {os.geteuid()}): "
            "another user created it first; remove it (it is not spotguard's) and try again"
        )
    if stat.S_IMODE(st.st_mode) & ~mode:
        os.fchmod(fd, mode)
        log.warning(
            "tightened the mode of a private directory",
            extra={"path": where, "mode": f"{stat.S_IMODE(st.st_mode):o}"},
        )


def private_dir(path: Path, *, mode: int = PRIVATE_DIR, private_from: Path | None = None) -> int:
    """An fd (``O_DIRECTORY``, the caller closes it) of ``path``, created with ``mode`` where
    missing and checked as the module doc says. Directories from ``private_from`` (default:
    ``path`` itself) down to ``path`` must be ours; those above only trusted."""
    real_parent = Path(os.path.realpath(Path(os.path.abspath(path)).parent))
    target = real_parent / Path(os.path.abspath(path)).name
    own_from = len(_parts(Path(os.path.realpath(private_from)))) if private_from else None
    parts = _parts(target)
    own_from = len(parts) if own_from is None else own_from
    fd = os.open("/", _DIR_FLAGS)
    where = Path("/")
    try:
        for i, name in enumerate(parts, start=1):
            where = where / name
            ours = i >= own_from
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode if ours else PRIVATE_DIR, dir_fd=fd)
            child = open_subdir(fd, name, str(where))
            os.close(fd)
            fd = child
            if ours:
                _owned(fd, str(where), mode)
            else:
                _trusted_ancestor(fd, str(where))
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def opened_private_dir(path: Path, **kw: object) -> Iterator[int]:
    """:func:`private_dir` as a context manager (the fd is closed on exit)."""
    fd = private_dir(path, **kw)  # type: ignore[arg-type]
    try:
        yield fd
    finally:
        os.close(fd)


def ensure_private_dir(path: Path, *, mode: int = PRIVATE_DIR) -> Path:
    """Create or check ``path`` as :func:`private_dir` does; returns it."""
    os.close(private_dir(path, mode=mode))
    return path


def open_dir_nofollow(path: Path, *, create: int | None = None) -> int:
    """An fd of the absolute ``path``, every component opened ``O_NOFOLLOW`` from ``/``
    (callers resolve a trusted prefix first, see module doc). ``create``: the mode of
    directories to create where missing (default: refuse a missing one). A symlink on the
    way raises :class:`UnsafePath`."""
    fd = os.open("/", _DIR_FLAGS)
    where = Path("/")
    try:
        for name in _parts(path):
            where = where / name
            if create is not None:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, create, dir_fd=fd)
            child = open_subdir(fd, name, str(where))
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_at(
    dirfd: int, name: str, data: bytes, *, mode: int | None = PRIVATE_FILE, fsync: bool = True
) -> None:
    """Replace ``name`` in the directory ``dirfd`` with ``data`` atomically: a fresh file of
    a random name (``O_EXCL|O_NOFOLLOW``), written, then renamed over ``name``. ``mode``:
    the file's mode (``None``: what ``open(2)`` gives, 0666 less the umask). ``fsync``: the
    file is synced before the rename and the directory after it, so a crash leaves either
    the old content or the new one under ``name``, and the new one once this returns."""
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o666 if mode is None else mode, dir_fd=dirfd)
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if mode is not None:
                os.fchmod(fd, mode)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dirfd)
        raise
    if fsync:
        os.fsync(dirfd)


def write_atomic(path: Path, data: bytes, *, mode: int | None = None, fsync: bool = True) -> None:
    """The one writer of node state (records, markers, spools): :func:`write_at` into
    ``path``'s directory, opened by its path (``O_DIRECTORY``; the name itself is never
    followed). For directories another user could swap, use :func:`write_file` (no link on
    the way) or :func:`write_at` on a :func:`private_dir` fd instead."""
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_at(dfd, path.name, data, mode=mode, fsync=fsync)
    finally:
        os.close(dfd)


def write_file(path: Path, data: bytes, *, mode: int = PRIVATE_FILE) -> None:
    """:func:`write_at` into ``path``'s directory, opened by :func:`open_dir_nofollow` from
    its real parent (a link planted at ``path`` or on the way is never followed)."""
    parent = Path(os.path.realpath(Path(os.path.abspath(path)).parent.parent)) / path.parent.name
    dfd = open_dir_nofollow(parent)
    try:
        write_at(dfd, path.name, data, mode=mode)
    finally:
        os.close(dfd)


def read_at(dirfd: int, name: str, *, limit: int) -> bytes:
    """The content of ``name`` in ``dirfd`` (a regular file, not followed if a link), at most
    ``limit`` bytes (:class:`UnsafePath` when larger)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"{name} is a symlink; refusing to read it") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise UnsafePath(f"{name} is not a regular file of at most {limit} bytes")
        chunks = []
        left = limit + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        out = b"".join(chunks)
        if len(out) > limit:
            raise UnsafePath(f"{name} grew past {limit} bytes while read")
        return out
    finally:
        os.close(fd)
