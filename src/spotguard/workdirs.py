"""Work directories of one operation, named after their owner, and the sweep of those whose
owner died.

A checkpoint or a restore makes small private directories in the temp dir (``$TMPDIR``, else
``/tmp``): the FIFOs through which CRIU's post-dump hook waits for the engine
(``spotguard-criu-``), a stream's sockets and CRIU's own files (``sg-dump-``, ``sg-serve-``),
a restore's pid file and log (``spotguard-restore-``); and under the state dir a container's
runtime archive (``ckpt-``, as large as the job's memory). They go when the operation ends — not
when its process is killed (SIGKILL, the OOM killer), which left one more on the host per
killed operation, with no end. Each name now carries its owner's pid, start time and PID
namespace (``sg-dump-PID.START.NS-XXXXXXXX``), and :func:`sweep` (the agent, as it starts)
removes those whose owner is gone (for ``ckpt-``, every new container work directory does it
first: :func:`spotguard.container.checkpoint.work_dir`). A directory of another naming, whose
owner runs, or made in another PID namespace (a container's or an ``unshare -p`` agent's that
shares the temp dir: its pids mean other processes here, and its processes are not seen) is
never touched; nor is one named without a namespace (by an older spotguard).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

from spotguard.checkpoint.procfacts import same_process, start_time

log = logging.getLogger(__name__)

#: every prefix :func:`make` is called with
PREFIXES = (
    "spotguard-criu-",
    "spotguard-criu-noplugins-",
    "sg-dump-",
    "sg-serve-",
    "spotguard-restore-",
    "ckpt-",
)
_OWNED = re.compile(
    "^(?:"
    + "|".join(re.escape(p) for p in PREFIXES)
    + r")(?P<pid>\d+)\.(?P<start>\d+)(?:\.(?P<ns>\d+))?-"
)


class Owner(NamedTuple):
    """What a work directory's name says of the process that made it."""

    pid: int
    start: int  # its start time (clock ticks after boot), 0 where unknown
    ns: int | None  # its PID namespace's inode; None in names of an older spotguard


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _proc_is_ours() -> bool:
    """Whether the /proc mounted here shows this process's PID namespace (its pids are the
    ones names carry): not so in a PID namespace that kept its parent's /proc."""
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return False


def temp_root() -> Path:
    """Where work directories go unless an operation names its own root."""
    return Path(os.environ.get("TMPDIR") or tempfile.gettempdir())


def judged_namespace() -> int:
    """The PID namespace whose names a sweep from here may judge: this process's, where the
    /proc mounted here shows it; 0 (judge nothing) elsewhere. Read once per sweep."""
    here = pid_namespace()
    return here if here and _proc_is_ours() else 0


def orphaned(pid: int, start: int, ns: int | None, *, judged: int | None = None) -> bool:
    """Whether the process a name says made something (``pid`` with its ``start`` time, 0
    unknown, in PID namespace ``ns``) is gone. Judged only for this process's own namespace
    with a /proc that shows it (``judged``: :func:`judged_namespace`, read here if not
    given): anything else — another namespace's pids, a name without a namespace — is never
    called orphaned (what it names may be running)."""
    here = judged_namespace() if judged is None else judged
    if not here or ns != here:
        return False
    return not same_process(pid, start or None)


def make(prefix: str, base: Path | None = None) -> Path:
    """A new private (0700) directory ``PREFIX<pid>.<start>.<ns>-XXXXXXXX`` under ``base``
    (the temp dir by default) owned, in name, by this process."""
    if prefix not in PREFIXES:
        raise ValueError(f"unknown work directory prefix {prefix!r}")
    owner = f"{prefix}{os.getpid()}.{start_time('self') or 0}.{pid_namespace()}-"
    return Path(tempfile.mkdtemp(prefix=owner, dir=base))


def owner(name: str) -> Owner | None:
    """The owner a work directory's name carries; None for any other name."""
    m = _OWNED.match(name)
    if not m:
        return None
    return Owner(int(m["pid"]), int(m["start"]), int(m["ns"]) if m["ns"] else None)


def sweep(base: Path | None = None) -> list[Path]:
    """Remove the work directories in ``base`` (the temp dir) whose owner no longer runs;
    returns them. Errors are logged, never raised: this is housekeeping."""
    root = base or temp_root()
    removed: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except OSError as exc:
        log.warning("work directories not swept", extra={"path": str(root), "error": str(exc)})
        return removed
    judged = judged_namespace()
    for e in entries:
        who = owner(e.name)
        if who is None or not e.is_dir(follow_symlinks=False):
            continue
        if not orphaned(*who, judged=judged):
            continue
        try:
            shutil.rmtree(e.path)
        except OSError as exc:
            log.warning("work directory not removed", extra={"path": e.path, "error": str(exc)})
            continue
        removed.append(Path(e.path))
    if removed:
        log.info(
            "work directories of killed operations removed",
            extra={"path": str(root), "removed": len(removed)},
        )
    return removed
