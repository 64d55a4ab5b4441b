"""Jobs: processes started by ``spotguard run`` so that they can be checkpointed and restored.

A job lives in ``<state_dir>/jobs/<name>/``::

    job.json      name, argv, cwd, pid (host pid of the job's init), created
    stdout        the job's standard output (append-only)
    stderr        the job's standard error (append-only)
    exit_status   written by the job's init when the command ends

The job runs in its own session and its own PID and mount namespaces (a private /proc),
under a tiny init (:mod:`spotguard.checkpoint.jobinit`); the dumped tree's root is that
init. GPU jobs too: CUDA initialises once the namespace has its own /proc. See
docs/limits.md for what that implies.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import stat
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spotguard import safefs
from spotguard.errors import ConfigError, JobError, JobNotFound, UnsafePath
from spotguard.names import check_job_name
from spotguard.statedir import StateDir

from . import jobinit, nccl, ncclctl, proctree
from .procfacts import same_process, start_time

JOB_FILE = "job.json"
_MAX_JOB_FILE = 1 << 20


@dataclass(frozen=True)
class JobInfo:
    """A job spotguard protects: its name, the host pid of its root and its directory."""

    name: str
    pid: int
    dir: Path
    argv: tuple[str, ...] = ()
    cwd: str | None = None
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    #: the root process's start time (clock ticks after boot): with ``pid`` its identity, so
    #: a stranger given the pid once the job ended is not taken for it (None: not recorded)
    start: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pid": self.pid,
            "dir": str(self.dir),
            "argv": list(self.argv),
            "cwd": self.cwd,
            "created": self.created,
            "start": self.start,
        }

    def running(self) -> bool:
        """Whether the job's root process still runs (its pid and start time, where known)."""
        return same_process(self.pid, self.start)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobInfo:
        return cls(
            name=str(data["name"]),
            pid=int(data["pid"]),
            dir=Path(data["dir"]),
            argv=tuple(data.get("argv", ())),
            cwd=data.get("cwd"),
            created=str(data.get("created", "")),
            start=int(data["start"]) if isinstance(data.get("start"), int) else None,
        )

    def with_pid(self, pid: int) -> JobInfo:
        """The job as process ``pid`` (restored, or adopted), with that process's start."""
        return JobInfo(self.name, pid, self.dir, self.argv, self.cwd, self.created, start_time(pid))

    def save(self) -> None:
        """Write ``job.json`` atomically (0600), relative to the job directory's fd through a
        fresh temporary file (:func:`spotguard.safefs.write_file`): a link planted in the
        directory, at the name or at a temporary name, is never followed."""
        if not self.dir.exists():
            os.close(safefs.open_dir_nofollow(_real(self.dir), create=safefs.PRIVATE_DIR))
        data = (json.dumps(self.to_json(), indent=2) + "\n").encode()
        safefs.write_file(self.dir / JOB_FILE, data, mode=safefs.PRIVATE_FILE)


def jobs_dir(state_dir: Path) -> Path:
    return StateDir(state_dir).jobs


def _default_name(argv: list[str]) -> str:
    base = re.sub(r"[^a-z0-9._-]+", "-", Path(argv[0]).name.lower()).strip("-._") or "job"
    return f"{base[:48]}-{uuid.uuid4().hex[:6]}"


#: A job directory holding this file is left alone by the agent's discovery
#: (``spotguard run --no-protect``).
NO_PROTECT = "no-protect"


def _check_runnable(cmd: str, path: str, workdir: str) -> None:
    """Refuse a command that cannot be run — before the job exists: the job's init would
    only find out by its ``exec`` failing, after ``spotguard run`` had said it started."""
    where = Path(workdir, cmd) if "/" in cmd else None
    if where is None and shutil.which(cmd, path=path) is None:
        raise ConfigError(f"cannot run {cmd!r}: no such command on the job's PATH ({path})")
    if where is not None and not (where.is_file() and os.access(where, os.X_OK)):
        why = "not an executable file" if where.exists() else "no such file"
        raise ConfigError(f"cannot run {cmd!r}: {why}")


async def start_job(
    argv: list[str],
    name: str | None = None,
    *,
    state_dir: Path,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    pid_namespace: bool = True,
    nccl_shim: Path | None = None,
    protect: bool = True,
    files: Mapping[str, bytes] | None = None,
) -> JobInfo:
    """Start ``argv`` as a checkpointable job and return its :class:`JobInfo`.

    Own session, own PID and mount namespaces (a private /proc, so CUDA initialises in
    there), stdin from /dev/null, stdout/stderr appended to files in the job directory, and
    NCCL made checkpointable (:mod:`.nccl`): with ``nccl_shim`` (an installed shim) it is
    preloaded and given the job's control directory (:func:`.ncclctl.control_dir`, created
    root only), and NCCL keeps its transports; without, the settings that turn off what the
    driver cannot capture, where ``env`` (default: ours) does not set them. A name already
    used by a live job is refused. ``pid_namespace=False`` starts it in the host's
    namespaces: restore then needs its exact PIDs free. ``protect=False``
    (``spotguard run --no-protect``): the job's opt-out from the agent's discovery
    (:data:`NO_PROTECT`) is in its directory before the job can be discovered; so are
    ``files`` (name → bytes: a park claim), written before ``job.json``.
    """
    if not argv:
        raise ConfigError("no command given (usage: spotguard run [--name N] -- CMD ...)")
    try:
        name = check_job_name(name) if name else _default_name(argv)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    workdir = str(Path(cwd) if cwd else Path.cwd())
    base = os.environ if env is None else env
    _check_runnable(argv[0], base.get("PATH", os.defpath), workdir)
    jdir = jobs_dir(state_dir) / name
    # the state dir, jobs/ and the job's directory: root's, 0700 (safefs), so no other user
    # reads the job's output or swaps a file root writes there
    safefs.ensure_private_dir(state_dir)
    safefs.ensure_private_dir(jobs_dir(state_dir))
    if (jdir / JOB_FILE).exists():
        old = _read(jdir)
        if old.running():
            raise JobError(f"job {name!r} is already running (pid {old.pid})")
        shutil.rmtree(jdir)
    safefs.ensure_private_dir(jdir)
    if not protect:  # before job.json: a discovery round in between would take the job
        safefs.write_file(jdir / NO_PROTECT, b"spotguard run --no-protect\n", mode=0o600)
    for fname, data in (files or {}).items():
        if "/" in fname or fname in ("", ".", "..", JOB_FILE):  # a caller's constant
            raise ValueError(f"not a file of a job's directory: {fname!r}")
        safefs.write_file(jdir / fname, data, mode=0o600)
    if nccl_shim is not None:
        ncclctl.prepare_restore(name)  # the control directory, empty, root only
        job_env = nccl.release_env(base, nccl_shim, ncclctl.control_dir(name))
    else:
        job_env = nccl.job_env(base)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        jobinit.__file__,
        str(jdir),
        *([] if pid_namespace else ["--no-pid-ns"]),
        "--",
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=workdir,
        env=job_env,
        start_new_session=True,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0 or not out.strip().isdigit():
        raise JobError(f"could not start job {name!r}: {err.decode(errors='replace').strip()}")
    pid = int(out)
    info = JobInfo(name=name, pid=pid, dir=jdir, argv=tuple(argv), cwd=workdir,
                   start=start_time(pid))  # fmt: skip
    info.save()
    return info


def _real(d: Path) -> Path:
    """``d`` with the links of its parent resolved. ``d`` itself is followed only where it is
    the link :func:`link_job_dir` makes for a job restored from another host's directory: a
    link owned by root in a jobs directory that only root can write (so no other user can have
    put it there, or swap it); anything else is never followed, and the caller's
    ``O_NOFOLLOW`` open refuses it."""
    d = Path(os.path.realpath(Path(os.path.abspath(d)).parent)) / d.name
    try:
        st = os.lstat(d)
        if not stat.S_ISLNK(st.st_mode) or st.st_uid != 0:
            return d
        parent = os.stat(d.parent)
        if parent.st_uid != 0 or parent.st_mode & 0o022:
            return d
        target = Path(os.path.abspath(d.parent / os.readlink(d)))
    except OSError:
        return d
    return Path(os.path.realpath(target.parent)) / target.name


def _read(jdir: Path) -> JobInfo:
    try:
        dfd = safefs.open_dir_nofollow(_real(jdir))
        try:
            data = safefs.read_at(dfd, JOB_FILE, limit=_MAX_JOB_FILE)
        finally:
            os.close(dfd)
        return JobInfo.from_json(json.loads(data))
    except FileNotFoundError as exc:
        raise JobNotFound(f"no job at {jdir}") from exc
    except (OSError, ValueError, KeyError, TypeError, UnsafePath) as exc:
        raise JobError(f"{jdir / JOB_FILE} is unreadable: {exc}") from exc


def list_jobs(state_dir: Path) -> list[JobInfo]:
    """Every job recorded under the state directory (live or not)."""
    root = jobs_dir(state_dir)
    if not root.is_dir():
        return []
    out = []
    for jdir in sorted(root.iterdir()):
        if (jdir / JOB_FILE).exists():
            try:
                out.append(_read(jdir))
            except JobError:
                continue
    return out


def resolve_job(pid_or_name: str | int, *, state_dir: Path) -> JobInfo:
    """Find a job by name or pid. A pid of a process not started by ``spotguard run`` gives
    an ad-hoc job named ``pid-<pid>`` whose directory is created on first use."""
    text = str(pid_or_name)
    if text.isdigit():
        pid = int(text)
        for job in list_jobs(state_dir):
            if job.pid == pid:
                return job
        if not proctree.alive(pid):
            raise JobNotFound(f"no process {pid}")
        cwd = None
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            argv = tuple(Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1])
        except OSError:
            argv = ()
        return JobInfo(
            name=f"pid-{pid}", pid=pid, dir=jobs_dir(state_dir) / f"pid-{pid}", argv=argv,
            cwd=cwd, start=start_time(pid),
        )  # fmt: skip
    try:
        check_job_name(text)
    except ValueError as exc:
        raise JobNotFound(f"no job {text!r}: {exc}") from exc
    return _read(jobs_dir(state_dir) / text)


def own_mount_ns(pid: int) -> bool:
    """True if ``pid`` lives in another mount namespace than this process (a job started
    in its own PID namespace has one, for its private /proc)."""
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return False


def own_net_ns(pid: int) -> bool:
    """True if ``pid`` lives in another network namespace than this process."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return False


def exit_status(job: JobInfo) -> int | None:
    """The job command's exit code once it has ended, else None."""
    try:
        return int((job.dir / "exit_status").read_text().strip())
    except (OSError, ValueError):
        return None


def link_job_dir(job: JobInfo, state_dir: Path) -> None:
    """Make the job findable by name under this host's state dir when it lives elsewhere
    (a job restored from an image whose directory is not under ``state_dir``)."""
    local = jobs_dir(state_dir) / job.name
    if local.absolute() == job.dir.absolute():
        return
    if local.is_symlink() or not local.exists():
        local.parent.mkdir(parents=True, exist_ok=True)
        local.unlink(missing_ok=True)
        local.symlink_to(job.dir, target_is_directory=True)
