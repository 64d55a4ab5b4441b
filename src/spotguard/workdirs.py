"""Work directories of one operation, named after their owner, and the sweep of those whose
owner died.

A checkpoint or a restore makes small private directories in the temp dir (``$TMPDIR``, else
``/tmp``): the FIFOs through which CRIU's post-dump hook waits for the engine
(``spotguard-criu-``), a stream's sockets and CRIU's own files (``sg-dump-``, ``sg-serve-``),
a restore's pid file and log (``spotguard-restore-``); and under the state dir a container's
runtime archive (``ckpt-``, as large as the job's memory). They go when the operation ends — not
when its process is killed (SIGKILL, the OOM killer), which left one more on the host per
killed operation, with no end. Each name now carries its owner's pid and start time
(``sg-dump-PID.START-XXXXXXXX``), and :func:`sweep` (the agent, as it starts) removes those
whose owner is gone (for ``ckpt-``, every new container work directory does it first:
:func:`spotguard.container.checkpoint.work_dir`). A directory of another naming, or whose
owner runs, is never touched.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

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
    "^(?:" + "|".join(re.escape(p) for p in PREFIXES) + r")(?P<pid>\d+)\.(?P<start>\d+)-"
)


def temp_root() -> Path:
    """Where work directories go unless an operation names its own root."""
    return Path(os.environ.get("TMPDIR") or tempfile.gettempdir())


def make(prefix: str, base: Path | None = None) -> Path:
    """A new private (0700) directory ``PREFIX<pid>.<start>-XXXXXXXX`` under ``base`` (the
    temp dir by default) owned, in name, by this process."""
    if prefix not in PREFIXES:
        raise ValueError(f"unknown work directory prefix {prefix!r}")
    owner = f"{prefix}{os.getpid()}.{start_time('self') or 0}-"
    return Path(tempfile.mkdtemp(prefix=owner, dir=base))


def owner(name: str) -> tuple[int, int] | None:
    """(pid, start time) a work directory's name carries; None for any other name."""
    m = _OWNED.match(name)
    return (int(m["pid"]), int(m["start"])) if m else None


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
    for e in entries:
        who = owner(e.name)
        if who is None or not e.is_dir(follow_symlinks=False):
            continue
        pid, start = who
        if same_process(pid, start or None):
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
