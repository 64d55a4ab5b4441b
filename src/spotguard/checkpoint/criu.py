"""CRIU driver: dump and restore a whole process tree with options chosen for real jobs.

Runs the ``criu`` binary (>= 4.0) as an asyncio subprocess. Every failure becomes a
:class:`~spotguard.errors.CriuError` carrying the command, exit code, log path and the
useful tail of CRIU's log (harmless lines CRIU prints on every run are dropped); a run past
its time limit is killed and becomes :class:`~spotguard.errors.StepTimeout`.

Options used for every dump: ``--ext-unix-sk`` (sockets to the outside, e.g. journald),
``--file-locks``; ``--tcp-established`` only when asked; ``--manage-cgroups MODE`` when set;
``--leave-running`` or (default) kill after the dump; ``--stream`` when an image streamer
serves the images directory. ``--shell-job`` is added only when the tree is not the leader
of its own session (``spotguard run`` jobs are).

A caller can run code while the tree is still frozen, after CRIU has written the image and
before it resumes or kills the tree (``on_frozen``): CRIU's ``post-dump`` action script
signals over a FIFO and waits for our answer. The engine uses it to snapshot the job's output
files at exactly the moment of the dump.

CRIU is started with PR_SET_PDEATHSIG=SIGKILL: if the process driving it dies, CRIU dies too,
and the tree it had seized is released by the kernel (ptrace detach) — never left half-dumped
and then killed by a CRIU nobody watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from spotguard.errors import CriuError, PreflightError, StepTimeout

log = logging.getLogger(__name__)

INSTALLED = "/opt/spotguard/criu/bin/criu"
MIN_MAJOR = 4
_HARMLESS = ("RLIMIT_NOFILE", "kdat", "Unable to get $HOME")
_PR_SET_PDEATHSIG = 1

#: runs under /bin/sh for every CRIU action; only post-dump talks to us
_ACTION_SCRIPT = """#!/bin/sh
[ "$CRTOOLS_SCRIPT_ACTION" = "post-dump" ] || exit 0
[ -n "$SPOTGUARD_HOOK_REQ" ] || exit 0
echo frozen > "$SPOTGUARD_HOOK_REQ" || exit 1
read -r reply < "$SPOTGUARD_HOOK_ACK" || exit 1
[ "$reply" = ok ]
"""


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _version_of(path: str) -> str | None:
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"Version:\s*(\S+)", out)
    return m.group(1) if m else None


def _major(version: str | None) -> int:
    try:
        return int((version or "0").split(".")[0])
    except ValueError:
        return 0


def find_criu(explicit: str | None = None) -> str:
    """The CRIU to run: ``explicit`` (setting ``criu`` / SPOTGUARD_CRIU), else ``criu`` on
    PATH if >= 4.0, else the one scripts/install-criu installs."""
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise PreflightError(f"criu {explicit!r} is not an executable (setting criu)")
        return explicit
    on_path = shutil.which("criu")
    if on_path and _major(_version_of(on_path)) >= MIN_MAJOR:
        return on_path
    if os.access(INSTALLED, os.X_OK):
        return INSTALLED
    raise PreflightError("no CRIU >= 4.0 found: run scripts/install-criu (or set SPOTGUARD_CRIU)")


def log_tail(path: Path, lines: int = 25) -> str:
    """The last useful lines of a CRIU log: error lines first, harmless noise dropped."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    useful = [ln for ln in text if not any(h in ln for h in _HARMLESS)]
    errors = [ln for ln in useful if "Error" in ln or "error" in ln]
    tail = useful[-lines:]
    head = [ln for ln in errors[-8:] if ln not in tail]
    return "\n".join([*head, *tail])


class _FrozenHook:
    """The FIFO pair through which CRIU's post-dump action script waits for the engine."""

    def __init__(self, callback: Callable[[], Awaitable[None]]) -> None:
        self.callback = callback
        self.dir = Path(tempfile.mkdtemp(prefix="spotguard-criu-"))
        self.script = self.dir / "action.sh"
        self.script.write_text(_ACTION_SCRIPT)
        self.script.chmod(0o700)
        self.req = self.dir / "req"
        self.ack = self.dir / "ack"
        os.mkfifo(self.req, 0o600)
        os.mkfifo(self.ack, 0o600)
        # O_RDWR keeps a writer/reader of our own open: no EOF storms, no lost answer.
        self.req_fd = os.open(self.req, os.O_RDWR | os.O_NONBLOCK)
        self.ack_fd = os.open(self.ack, os.O_RDWR | os.O_NONBLOCK)
        self.called = False
        self.error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None

    def env(self) -> dict[str, str]:
        return {"SPOTGUARD_HOOK_REQ": str(self.req), "SPOTGUARD_HOOK_ACK": str(self.ack)}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        loop.add_reader(self.req_fd, ready.set)
        try:
            await ready.wait()
        finally:
            loop.remove_reader(self.req_fd)
        with contextlib.suppress(BlockingIOError):
            os.read(self.req_fd, 64)
        self.called = True
        reply = b"ok\n"
        try:
            await self.callback()
        except BaseException as exc:
            self.error = exc
            reply = b"fail\n"
            raise
        finally:
            os.write(self.ack_fd, reply)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for fd in (self.req_fd, self.ack_fd):
            os.close(fd)
        shutil.rmtree(self.dir, ignore_errors=True)


class Criu:
    """One CRIU binary and the options spotguard uses with it."""

    def __init__(self, path: str | None = None, *, timeout: float = 600.0) -> None:
        self.path = find_criu(path)
        self.timeout = timeout
        self._version: str | None = None

    async def version(self) -> str:
        """CRIU's version string, e.g. ``4.1.1``."""
        if self._version is None:
            v = await asyncio.to_thread(_version_of, self.path)
            if v is None:
                raise PreflightError(f"{self.path} --version gave no version")
            self._version = v
        return self._version

    async def check(self) -> tuple[bool, str]:
        """``criu check``: (passed, its output)."""
        proc = await asyncio.create_subprocess_exec(
            self.path, "check", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        out, _ = await proc.communicate()
        text = "\n".join(
            ln
            for ln in out.decode(errors="replace").splitlines()
            if not any(h in ln for h in _HARMLESS)
        )
        return proc.returncode == 0, text

    async def dump(
        self,
        pid: int,
        images_dir: Path,
        *,
        leave_running: bool,
        stream: bool = False,
        tcp_established: bool = False,
        manage_cgroups: str | None = None,
        shell_job: bool = False,
        on_frozen: Callable[[], Awaitable[None]] | None = None,
        log_file: Path | None = None,
        time_limit: float | None = None,
    ) -> Path:
        """Dump the tree rooted at ``pid`` into ``images_dir``; returns CRIU's log path.

        ``on_frozen`` runs after the image is written and before CRIU resumes or kills the
        tree; if it raises, CRIU is told to fail and leaves the tree running.
        """
        log_path = log_file or images_dir / "criu-dump.log"
        args = ["dump", "-t", str(pid), "-D", str(images_dir), "-o", str(log_path), "-v2"]
        args += ["--ext-unix-sk", "--file-locks"]
        if leave_running:
            args.append("--leave-running")
        if stream:
            args.append("--stream")
        if tcp_established:
            args.append("--tcp-established")
        if manage_cgroups:
            args.append(f"--manage-cgroups={manage_cgroups}")
        if shell_job:
            args.append("--shell-job")
        hook = _FrozenHook(on_frozen) if on_frozen else None
        env = dict(os.environ)
        if hook:
            args += ["--action-script", str(hook.script)]
            env.update(hook.env())
            hook.start()
        try:
            await self._run(args, log_path, "dump", time_limit, env)
        except CriuError:
            if hook and hook.error is not None:
                raise hook.error from None
            raise
        finally:
            if hook:
                await hook.close()
        if hook and not hook.called:
            raise CriuError(
                "criu dump finished without running the post-dump hook",
                argv=[self.path, *args],
                log_path=str(log_path),
                log_tail=log_tail(log_path),
            )
        return log_path

    async def restore(
        self,
        images_dir: Path,
        *,
        stream: bool = False,
        tcp_established: bool = False,
        manage_cgroups: str | None = None,
        shell_job: bool = False,
        log_file: Path | None = None,
        time_limit: float | None = None,
    ) -> int:
        """Restore the tree in ``images_dir`` detached from us; returns the root's host pid."""
        work = Path(tempfile.mkdtemp(prefix="spotguard-restore-"))
        log_path = log_file or work / "criu-restore.log"
        pidfile = work / "pid"
        args = [
            "restore",
            "-D",
            str(images_dir),
            "-o",
            str(log_path),
            "-v2",
            "--restore-detached",
            "--pidfile",
            str(pidfile),
            "--ext-unix-sk",
            "--file-locks",
        ]
        if stream:
            args.append("--stream")
        if tcp_established:
            args.append("--tcp-established")
        if manage_cgroups:
            args.append(f"--manage-cgroups={manage_cgroups}")
        if shell_job:
            args.append("--shell-job")
        try:
            await self._run(args, log_path, "restore", time_limit, None)
            try:
                return int(pidfile.read_text().strip())
            except (OSError, ValueError) as exc:
                raise CriuError(
                    "criu restore wrote no pid file",
                    argv=[self.path, *args],
                    log_path=str(log_path),
                    log_tail=log_tail(log_path),
                ) from exc
        finally:
            if log_file is None:
                # keep the log next to the images when we can, for whoever debugs later
                with contextlib.suppress(OSError):
                    shutil.copyfile(log_path, images_dir / "criu-restore.log")
            shutil.rmtree(work, ignore_errors=True)

    async def _run(
        self,
        args: Sequence[str],
        log_path: Path,
        what: str,
        time_limit: float | None,
        env: dict[str, str] | None,
    ) -> None:
        argv = [self.path, *args]
        log.debug("running criu", extra={"argv": argv})
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise CriuError(f"cannot run criu {what}: {exc}", argv=argv) from exc
        limit = time_limit if time_limit is not None else self.timeout
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), limit)
        except (TimeoutError, asyncio.CancelledError) as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.shield(proc.wait())
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise StepTimeout(
                f"criu {what} ran past {limit:.0f} s and was stopped\n{log_tail(log_path)}"
            ) from exc
        if proc.returncode != 0:
            tail = log_tail(log_path) or out.decode(errors="replace")[-4000:]
            raise CriuError(
                f"criu {what} failed",
                argv=argv,
                returncode=proc.returncode,
                log_path=str(log_path),
                log_tail=tail,
            )
