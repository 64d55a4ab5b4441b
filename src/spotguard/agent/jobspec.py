"""Which job a ``--job`` value names: a pid, a job name from ``spotguard run``, or a cgroup.

A cgroup (a path under /sys/fs/cgroup, or relative to it) names the process tree whose root
is the one process in the cgroup whose parent is outside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JOB_FILE, JobInfo, jobs_dir, resolve_job
from spotguard.errors import JobNotFound, SpotguardError

log = logging.getLogger(__name__)

#: which run of a job: (pid, job.json inode, job.json mtime)
Incarnation = tuple[int, int, int]

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the comm field may hold spaces and parentheses: split after the last ')'
    return int(stat.rsplit(")", 1)[1].split()[1])


def cgroup_root_pid(path: Path) -> int:
    """The root process of the tree in cgroup ``path`` (its parent lives elsewhere)."""
    procs_file = path / "cgroup.procs"
    try:
        pids = [int(x) for x in procs_file.read_text().split()]
    except OSError as exc:
        raise JobNotFound(f"no cgroup at {path}: {exc.strerror}") from exc
    if not pids:
        raise JobNotFound(f"cgroup {path} holds no process")
    members = set(pids)
    roots = [p for p in pids if _ppid(p) not in members]
    if len(roots) != 1:
        raise JobNotFound(
            f"cgroup {path} holds {len(roots)} separate process trees; protect each by pid"
        )
    return roots[0]


def resolve(spec: str, *, state_dir: Path) -> JobInfo:
    """The :class:`JobInfo` for ``spec`` (pid, job name or cgroup path)."""
    spec = spec.strip()
    if spec.startswith("/") or spec.startswith("cgroup:"):
        raw = Path(spec.removeprefix("cgroup:"))
        if raw.is_relative_to(CGROUP_ROOT):
            path = raw
        else:
            path = CGROUP_ROOT / (raw.relative_to("/") if raw.is_absolute() else raw)
        return resolve_job(cgroup_root_pid(path), state_dir=state_dir)
    return resolve_job(spec, state_dir=state_dir)


async def resolve_when_up(
    spec: str, state_dir: Path, every_s: float, missing: Callable[[], None]
) -> JobInfo:
    """:func:`resolve` ``spec``, trying again every ``every_s`` seconds until it resolves
    (the job may start after the agent); the first miss is logged and ``missing()`` told."""
    warned = False
    while True:
        try:
            return resolve(spec, state_dir=state_dir)
        except SpotguardError as exc:
            if not warned:
                log.warning(
                    "job not found; retrying", extra={"step": "job", "job": spec, "error": str(exc)}
                )
                missing()
                warned = True
            await asyncio.sleep(every_s)


def by_name(spec: str) -> bool:
    """Whether ``spec`` names a job by name (not by pid or cgroup): such a job can be
    followed across restores (``spotguard restore`` keeps the name, not the pid)."""
    spec = spec.strip()
    return not (spec.isdigit() or spec.startswith("/") or spec.startswith("cgroup:"))


def incarnation(info: JobInfo) -> Incarnation | None:
    """Which run of the job ``info`` is: its pid and its ``job.json`` (inode, mtime), which
    ``spotguard run`` and every restore write anew. A job restored with its old pid (no PID
    namespace of its own) is another incarnation all the same; None: no ``job.json``."""
    try:
        st = (info.dir / JOB_FILE).stat()
    except OSError:
        return None
    return info.pid, st.st_ino, st.st_mtime_ns


#: how often the ``job.json`` of a job that ended is looked at (one ``stat``): a wake, an
#: unpark or a restore writes it anew, and the agent protects (and shows) the new pid at once
LOOK_S = 0.1


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


async def comes_back(
    spec: str, seen: Incarnation | None, state_dir: Path, period_s: float
) -> JobInfo:
    """Wait until the job ``spec`` runs again as another incarnation than ``seen``: restored
    by hand (``spotguard restore``), unparked or woken by a client, or by an assignment.
    Its ``job.json`` is looked at every :data:`LOOK_S` and the job resolved as soon as that
    file is not the one ``seen`` had (a job woken from a park showed its old pid for up to
    ``period_s`` before); the job is resolved every ``period_s`` in any case."""
    loop = asyncio.get_running_loop()
    marker = jobs_dir(state_dir) / spec.strip() / JOB_FILE
    old = seen[1:] if seen is not None else None
    full_at = loop.time() + period_s
    while True:
        await asyncio.sleep(LOOK_S)
        now = _stamp(marker)
        if now == old and loop.time() < full_at:
            continue
        old, full_at = now, loop.time() + period_s  # this file is looked at once
        with contextlib.suppress(SpotguardError):
            info = resolve(spec, state_dir=state_dir)
            if incarnation(info) != seen and proctree.alive(info.pid):
                what = {"step": "protect", "job": info.name, "pid": info.pid}
                log.info("job runs again; protecting it", extra=what)
                return info
