"""One agent per job, across state dirs: a lock keyed by the job's process identity.

The state dir lock (:func:`spotguard.agent.startup.lock_state_dir`) keeps two agents off one
state dir, but two agents with different state dirs could both be told to protect the same
process (a pid in both configs, a job discovered by one and named by the other): both then
checkpointed it at a notice and both dumps failed ("another freeze is in progress"). So the
daemon takes this lock when a worker starts protecting a job, and a second agent that finds
it held refuses the job with one log line (status: ``stood_down`` with the ``reason``).

The key is the job's identity — boot id, pid and start time
(:class:`~spotguard.agent.identity.Identity`) — so a job restored with a new pid, or a
stranger given its old pid, never meets a stale lock. The files live in
``/run/spotguard/jobs/`` (memory, gone at reboot; the directory root's only, 0700), each
holding the pid and state dir of the agent that holds it; ``flock`` goes with the holder's
process, so a killed agent holds nothing. A lock file is removed on release once its job's
process is gone (its key never comes back), and each :func:`take` removes the files of
processes gone since (an agent stopped while its job ran on); while the job runs its file
stays, so a waiting agent never locks an unlinked file. An agent that cannot make the
directory (not root) protects the job without the lock, with one debug line.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from pathlib import Path

from .identity import Identity

log = logging.getLogger(__name__)

LOCK_DIR = Path("/run/spotguard/jobs")

#: how long a loser waits for the winner of a lock to write its name: the winner locks first
#: and writes next, so a loser in between read an empty file ("pid ?")
HOLDER_WAIT_S = 1.0


def holder_of(fd: int, wait_s: float = HOLDER_WAIT_S) -> str:
    """What the holder of the lock on ``fd`` wrote in it (its name), waiting up to ``wait_s``
    for a holder that has locked but not yet written; "" when it wrote nothing by then."""
    deadline = time.monotonic() + wait_s
    while True:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if text or time.monotonic() >= deadline:
            return text
        time.sleep(0.02)


def write_holder(fd: int, name: str) -> None:
    """Write this holder's ``name`` into its locked file: over the old text first, then cut
    to length, so a reader never meets the file empty between a truncate and the write."""
    data = name.encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


class JobLock:
    """The lock of one job (:func:`take`): held (``other`` is None), not held for want of a
    lock directory or an identity, or held by another agent (``other`` says which)."""

    def __init__(
        self, ident: Identity | None, fd: int | None, path: Path | None, other: str | None
    ) -> None:
        self.ident = ident
        self._fd = fd
        self.path = path
        self.other = other

    def release(self) -> None:
        """Let go (idempotent); the file goes too once the job's process is gone."""
        if self._fd is None:
            return
        if self.path is not None and self.ident is not None and not self.ident.alive():
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(self._fd)
        self._fd = None


def _key(ident: Identity) -> str:
    return f"{ident.boot or 'noboot'}-{ident.pid}-{ident.start}.lock"


def _sweep(root: Path) -> None:
    """Remove the lock files of processes that are gone (another boot, or pid and start
    time no longer a live process): nobody protects those any more."""
    with contextlib.suppress(OSError):
        for f in root.iterdir():
            rest, _, start = f.name.removesuffix(".lock").rpartition("-")
            boot, _, pid = rest.rpartition("-")
            try:
                ident = Identity(int(pid), int(start), boot if boot != "noboot" else None)
            except ValueError:
                continue
            if not ident.alive():
                with contextlib.suppress(OSError):
                    f.unlink()


def _lock_dir(root: Path) -> bool:
    """Make ``root`` (root's only, 0700); False when this process cannot."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = root.lstat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            os.chmod(root, 0o700, follow_symlinks=False)
    except OSError as exc:
        log.debug("no job lock directory", extra={"path": str(root), "error": str(exc)})
        return False
    return True


def take(ident: Identity | None, state_dir: Path, root: Path = LOCK_DIR) -> JobLock:
    """Lock the job ``ident`` names for this agent (whose state dir is ``state_dir``);
    never waits. A job without an identity (its process is gone) is not locked."""
    if ident is None or not _lock_dir(root):
        return JobLock(ident, None, None, None)
    _sweep(root)
    path = root / _key(ident)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        log.debug("no job lock", extra={"path": str(path), "error": str(exc)})
        return JobLock(ident, None, None, None)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = holder_of(fd) or "pid ?"
        os.close(fd)
        return JobLock(ident, None, path, f"another agent ({holder}) protects this job")
    write_holder(fd, f"pid {os.getpid()}, state dir {state_dir}")
    return JobLock(ident, fd, path, None)
