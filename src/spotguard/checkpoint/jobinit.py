"""The init process of a ``spotguard run`` job (stdlib only; run as a script, not imported).

Why a tiny init: a job must live in its own PID namespace so that CRIU can restore it on any
machine without colliding with PIDs in use there, and PID 1 of a namespace must reap orphans
and pass signals on (a plain program as PID 1 ignores SIGTERM). This file is executed by path
(``python -I jobinit.py DIR -- CMD ...``) so the init holds only the interpreter, not
spotguard and its libraries: that keeps every image a few MB smaller.

CUDA cannot initialise inside a PID namespace that still sees the host's /proc (driver error
304 on the H100 machines), so GPU jobs are started with ``--no-pid-ns``: then the init is an
ordinary reaper and restore needs the job's PIDs to be free (preflight checks).

Steps: unshare(CLONE_NEWPID) (unless --no-pid-ns) → fork (the child is PID 1 of the new
namespace and prints its host pid on stdout for the caller) → the launcher exits → the init
starts a new session,
points stdin at /dev/null and stdout/stderr at ``DIR/stdout`` / ``DIR/stderr`` (append-only),
forks the command, forwards signals to it, reaps every child and, when the command ends,
writes its exit code to ``DIR/exit_status`` and exits with it (the namespace ends with it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

CLONE_NEWPID = 0x20000000
CLONE_NEWNS = 0x00020000
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def _libc_call(what: str, code: int) -> None:
    if code != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)} (needs root)")


def _unshare_pid() -> None:
    """New PID and mount namespaces; every mount private so nothing leaks to the host."""
    libc = ctypes.CDLL(None, use_errno=True)
    _libc_call("unshare(CLONE_NEWPID|CLONE_NEWNS)", libc.unshare(CLONE_NEWPID | CLONE_NEWNS))
    _libc_call("make / private", libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None))


#: the job's mount namespace as it was made (a copy of the host's), kept in its directory:
#: a host mount the host later drops stays in the copy, and the freeze must know it for one
#: of the host's (spotguard.checkpoint.mounts, "stale copies")
MOUNTS_AT_START = "mounts-at-start"


def _record_mounts(job_dir: str) -> None:
    """Copy this namespace's mountinfo into ``job_dir`` (0600, never through a link)."""
    with open("/proc/self/mountinfo", "rb") as f:
        data = f.read()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(os.path.join(job_dir, MOUNTS_AT_START), flags, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _mount_proc() -> None:
    """A /proc of the new PID namespace (run as its PID 1), in place of the host's (not
    over it: CRIU restores a plain mount tree more reliably than an overmounted one)."""
    libc = ctypes.CDLL(None, use_errno=True)
    _libc_call("detach the host's /proc", libc.umount2(b"/proc", MNT_DETACH))
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    _libc_call("mount /proc", libc.mount(b"proc", b"/proc", b"proc", flags, None))


#: 0600 and never through a link: the job's output is its own (docs/security.md)
OUTPUT_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW


def _check_output(job_dir: str) -> None:
    """Open (and close) the job's output files as the init will, before the caller is told
    the job started: a link planted there fails the start, not the job after it."""
    for name in ("stdout", "stderr"):
        os.close(os.open(os.path.join(job_dir, name), OUTPUT_FLAGS, 0o600))


def _redirect(job_dir: str) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(os.path.join(job_dir, "stdout"), OUTPUT_FLAGS, 0o600)
    err = os.open(os.path.join(job_dir, "stderr"), OUTPUT_FLAGS, 0o600)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.closerange(3, 1024)


def _init(job_dir: str, argv: list[str]) -> int:
    os.setsid()
    _redirect(job_dir)
    child = os.fork()
    if child == 0:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            os.write(2, f"spotguard: cannot run {argv[0]!r}: {exc}\n".encode())
        os._exit(127)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    code = 0
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code
            tmp = os.path.join(job_dir, f".exit_status.{os.getpid()}.{time.time_ns()}.tmp")
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"{code}\n")
                f.flush()
                os.fsync(f.fileno())  # the job's outcome survives a crash of the VM
            os.replace(tmp, os.path.join(job_dir, "exit_status"))
            with contextlib.suppress(OSError):
                dfd = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            break
    return code


def _run_init(job_dir: str, argv: list[str]) -> int:
    try:
        code = _init(job_dir, argv)
    except BaseException as exc:  # noqa: BLE001 - the init must never print a traceback
        try:
            os.write(2, f"spotguard init: {exc}\n".encode())
        finally:
            os._exit(126)
    os._exit(code)


def _become_init(job_dir: str, argv: list[str]) -> None:
    """PID 1 of the new namespace: mount its /proc, then exec this script again as the init.

    The exec matters: files opened and mapped before ``unshare(CLONE_NEWNS)`` (the
    interpreter, its libraries) still belong to the host's mounts, which CRIU cannot find
    inside the job's mount namespace ("Can't lookup mount=N"); after the exec every mapping
    comes from the job's own mounts.
    """
    try:
        _mount_proc()
        os.execv(sys.executable, [sys.executable, "-I", __file__, "--init", job_dir, "--", *argv])
    except BaseException as exc:  # noqa: BLE001 - the init must never print a traceback
        try:
            os.write(2, f"spotguard init: {exc}\n".encode())
        finally:
            os._exit(126)


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--init"]:
        if len(args) < 4 or args[2] != "--":
            return 2
        return _run_init(args[1], args[3:])
    pid_ns = "--no-pid-ns" not in args[:2]
    if not pid_ns:
        args.remove("--no-pid-ns")
    if len(args) < 3 or args[1] != "--":
        sys.stderr.write("usage: jobinit.py JOB_DIR [--no-pid-ns] -- CMD [ARG...]\n")
        return 2
    job_dir, argv = args[0], args[2:]
    try:
        _check_output(job_dir)
    except OSError as exc:
        sys.stderr.write(f"spotguard init: cannot write the job's output in {job_dir}: {exc}\n")
        return 1
    if pid_ns:
        try:
            _unshare_pid()
            _record_mounts(job_dir)
        except OSError as exc:
            sys.stderr.write(f"spotguard init: {exc}\n")
            return 1
    pid = os.fork()
    if pid != 0:
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()
        return 0
    if pid_ns:
        _become_init(job_dir, argv)
    return _run_init(job_dir, argv)


if __name__ == "__main__":
    sys.exit(main())
