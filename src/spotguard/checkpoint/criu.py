"""CRIU driver: dump and restore a whole process tree with options chosen for real jobs.

Runs the ``criu`` binary (>= 4.2.1) as an asyncio subprocess. Every failure becomes a
:class:`~spotguard.errors.CriuError` carrying the command, exit code, log path and the
useful tail of CRIU's log (harmless lines CRIU prints on every run are dropped); a run past
its time limit is killed and becomes :class:`~spotguard.errors.StepTimeout`.

Options used for every dump: ``--ext-unix-sk`` (sockets to the outside, e.g. journald),
``--file-locks``; ``--tcp-established`` with ``--network-lock METHOD`` when the tree holds
connected TCP sockets (the freeze preflight decides, :mod:`.scan`); restore always allows
established connections (CRIU reads the lock method from the image), and leaves the tree
stopped (``--leave-stopped``) when the caller still has memory to put back;
``--manage-cgroups MODE`` when set; ``--leave-running`` or (default) kill after the dump;
``--stream`` when an image streamer serves the images directory. ``--shell-job`` is added
only when the tree is not the leader of its own session (``spotguard run`` jobs are).

Plugins: CRIU loads plugins only from the ``--libdir`` given: the one scripts/install-criu
builds next to CRIU (``spotguard_nvleftover.so``: leftover ``/dev/nvidia*`` fds and mappings of
processes with no CUDA context become inert stand-ins; the prefixes it treats so come from
``SPOTGUARD_CRIU_LEFTOVER_DEVICES``, default ``/dev/nvidia``) or, where it is not installed, an
empty directory: never the host's plugins, and an image that needed the plugin fails to
restore without it ("Missing required plugin") instead of reopening real devices.

Parallel memory (``--page-workers N``, a patch scripts/install-criu applies to Debian's CRIU,
packaging/criu-patches): a dump writes the pages of up to N processes at once and a restore
populates each process's memory with up to N threads while its pages are read in. Given to
every dump and restore when the running CRIU has it (``criu --help``, probed once per binary),
with N = ``page_workers`` (default: the machine's CPUs; 0 or 1: off; default where the caller
gives none: ``SPOTGUARD_CRIU_PAGE_WORKERS``); a dump raises ``fs.pipe-max-size`` to 64 MiB first
(:data:`PAGE_PIPE_MAX`). A CRIU without it is used as it is, and one log line says so.

A caller can run code while the tree is still frozen, after CRIU has written the image and
before it resumes or kills the tree (``on_frozen``): CRIU's ``post-dump`` action script
signals over a FIFO and waits for our answer (the engine snapshots the job's output files).

A dump's CRIU outlives the process that started it (its own session, no parent-death
signal). CRIU runs code of its own inside every task it dumps (the parasite); killed there,
the kernel lets the tasks go wherever they are: in the parasite (its mapping left in the job)
or, while CRIU sets it up, at a breakpoint nobody traces (the job dies of SIGTRAP). Left
alive, CRIU unwinds the dump itself when its owner is gone: a streamed image's reader is gone
with the owner, so CRIU's next write fails and it cures and resumes every task; an image
CRIU has written asks the owner in the post-dump hook — every dump has one — and the hook's
script answers "no" once the owner is gone (checked by pid and start time), so the tree is
resumed, never killed with no one to keep its image. A restarted agent waits for such a CRIU
to let the job go before it brings the job back (:mod:`.recovery`). A dump given up by its
caller (cancelled, or past its time limit) is not killed either: the hook answers no and the
caller aborts the stream, and the engine waits for CRIU to let the tree go before bringing
the job back (killing it only past :data:`~.engine.CRIU_UNWIND_S`). A restore's CRIU dies
with its owner (PR_SET_PDEATHSIG): what it leaves is killed by recovery, the image intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import weakref
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Literal

from spotguard import workdirs
from spotguard.errors import CriuError, PreflightError, StepTimeout
from spotguard.stream.pipes import ensure_pipe_max

from .criufind import (
    DEFAULT_LEFTOVER_DEVICES,
    EXTERNAL_PAGES_FLAG,
    HARMLESS,
    LEFTOVER_DEVICES_ENV,
    MIN_VERSION_TEXT,
    PAGE_PIPE_MAX,
    PAGE_WORKERS_FLAG,
    PLUGIN_NAME,
    default_page_workers,
    find_criu,
    find_plugin_dir,
    has_external_pages,
    has_page_workers,
    log_tail,
    version_of,
    version_ok,
)
from .criuhook import FrozenHook, nothing

__all__ = [
    "MIN_VERSION_TEXT",
    "PAGE_WORKERS_FLAG",
    "PLUGIN_NAME",
    "Criu",
    "find_criu",
    "find_plugin_dir",
    "has_external_pages",
    "has_page_workers",
    "version_ok",
]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
#: a job in its own mount namespace (``spotguard run``'s jobs: a private /proc for their PID
#: namespace): every mount that is the host's own (/, /dev, /sys, ...) is recorded as an
#: external bind (``mnt[]`` = detect them), not dumped by content; restore rebuilds the
#: namespace on the host's root (CRIU's mount engine needs ``--root`` for that)
_MOUNT_NS_DUMP = ["--external", "mnt[]"]
_MOUNT_NS_RESTORE = ["--external", "mnt[]", "--root", "/"]


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Criu:
    """One CRIU binary and the options spotguard uses with it."""

    def __init__(
        self,
        path: str | None = None,
        *,
        timeout: float = 600.0,
        plugins: Path | Literal["auto"] | None = "auto",
        leftover_devices: Sequence[str] | None = None,
        page_workers: int | None = None,
        log_level: int = 2,
        log_dir: Path | None = None,
        pipe_max: int | None = PAGE_PIPE_MAX,
    ) -> None:
        """``plugins``: the ``--libdir`` to give CRIU; ``"auto"`` finds the installed one,
        ``None`` runs CRIU with no plugins at all. ``leftover_devices``: device path prefixes
        the plugin treats as leftovers (None: CRIU's environment decides, default
        ``/dev/nvidia``). ``page_workers``: threads moving memory pages (see module doc;
        None: :func:`default_page_workers`; 0 or 1: one process after another). ``log_level``:
        CRIU's ``-v`` (4: per-task timings, for tests and benchmarks); ``log_dir``: where its
        logs go when the caller names none (default: the images directory). ``pipe_max``:
        ``fs.pipe-max-size`` is raised to it before a dump with page workers (None: left)."""
        self.path = find_criu(path)
        self.timeout = timeout
        self.plugin_dir = find_plugin_dir(self.path) if plugins == "auto" else plugins
        self.leftover_devices = list(leftover_devices) if leftover_devices is not None else None
        self.page_workers = default_page_workers() if page_workers is None else page_workers
        self.log_level = log_level
        self.log_dir = log_dir
        self.pipe_max = pipe_max
        self._no_plugins: Path | None = None
        self._version: str | None = None
        self._locks: frozenset[str] | None = None

    def leftover_prefixes(self) -> list[str]:
        """Device path prefixes CRIU dumps as leftovers through the plugin (none without it);
        the same rule the plugin applies (each must start with ``/dev/``)."""
        if self.plugin_dir is None:
            return []
        if self.leftover_devices is not None:
            raw = self.leftover_devices
        else:
            raw = os.environ.get(LEFTOVER_DEVICES_ENV, DEFAULT_LEFTOVER_DEVICES).split(":")
        return [p for p in raw if p.startswith("/dev/")]

    def handles_device(self, path: str) -> bool:
        """True if a reference to device ``path`` is dumped by the plugin (so a preflight
        scan must not refuse it)."""
        return any(path.startswith(p) for p in self.leftover_prefixes())

    def _plugin_args(self) -> list[str]:
        """``--libdir``: our plugin directory, or an empty one of our own (see module doc)."""
        libdir = self.plugin_dir
        if libdir is None:
            if self._no_plugins is None:
                self._no_plugins = workdirs.make("spotguard-criu-noplugins-")
                weakref.finalize(self, shutil.rmtree, self._no_plugins, True)
            libdir = self._no_plugins
        return ["--libdir", str(libdir)]

    async def has_external_pages(self) -> bool:
        """Whether this CRIU can leave ranges of memory to spotguard (``--external-pages``)."""
        return await asyncio.to_thread(has_external_pages, self.path)

    async def page_worker_args(self) -> list[str]:
        """``--page-workers N`` when it is on and this CRIU has it, else nothing."""
        if self.page_workers < 2:
            return []
        if not await asyncio.to_thread(has_page_workers, self.path):
            return []
        return [PAGE_WORKERS_FLAG, str(self.page_workers)]

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        if self.leftover_devices is not None:
            env[LEFTOVER_DEVICES_ENV] = ":".join(self.leftover_devices)
        env.update(extra or {})
        return env

    async def version(self) -> str:
        """CRIU's version string, e.g. ``4.2.1``."""
        if self._version is None:
            v = await asyncio.to_thread(version_of, self.path)
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
            if not any(h in ln for h in HARMLESS)
        )
        return proc.returncode == 0, text

    async def network_locks(self) -> frozenset[str]:
        """The ``--network-lock`` methods that work here: ``nftables`` when this CRIU and
        kernel support it (``criu check --feature network_lock_nftables``), ``iptables``
        when iptables-restore is installed. Probed once per instance."""
        if self._locks is None:
            found = set()
            proc = await asyncio.create_subprocess_exec(
                self.path,
                "check",
                "--feature",
                "network_lock_nftables",
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            if await proc.wait() == 0:
                found.add("nftables")
            if shutil.which("iptables-restore") and shutil.which("iptables"):
                found.add("iptables")
            self._locks = frozenset(found)
        return self._locks

    async def dump(
        self,
        pid: int,
        images_dir: Path,
        *,
        leave_running: bool,
        stream: bool = False,
        tcp_established: bool = False,
        network_lock: str | None = None,
        manage_cgroups: str | None = None,
        shell_job: bool = False,
        on_frozen: Callable[[], Awaitable[None]] | None = None,
        log_file: Path | None = None,
        time_limit: float | None = None,
        mount_ns: bool = False,
        ghost_limit: int | None = None,
        external_mounts: Sequence[str] = (),
        external_pages: Sequence[str] = (),
    ) -> Path:
        """Dump the tree rooted at ``pid`` into ``images_dir``; returns CRIU's log path.

        ``external_pages``: ``PID:START-END`` ranges whose pages CRIU leaves out (spotguard
        copies them itself, :mod:`.gpupages`); only given where :meth:`has_external_pages`.

        ``external_mounts``: ``--external mnt[...]`` options naming the host mounts of the
        job's namespace (:mod:`.mounts`), given before CRIU's own detection.

        ``on_frozen`` runs after the image is written and before CRIU resumes or kills the
        tree; if it raises, CRIU is told to fail and leaves the tree running. Every dump has
        the hook, with or without ``on_frozen``: it is how a CRIU that outlived its owner
        learns that nobody keeps the image (module doc).
        """
        log_path = log_file or (self.log_dir or images_dir) / "criu-dump.log"
        args = ["dump", "-t", str(pid), "-D", str(images_dir), "-o", str(log_path)]
        args.append(f"-v{self.log_level}")
        args += ["--ext-unix-sk", "--file-locks"]
        if leave_running:
            args.append("--leave-running")
        if stream:
            args.append("--stream")
        if tcp_established:
            args.append("--tcp-established")
            if network_lock:
                args += ["--network-lock", network_lock]
        if manage_cgroups:
            args.append(f"--manage-cgroups={manage_cgroups}")
        if shell_job:
            args.append("--shell-job")
        if ghost_limit is not None:  # deleted files the job still holds go into the image
            args += ["--ghost-limit", str(ghost_limit)]
        args += self._plugin_args()
        workers = await self.page_worker_args()
        if workers and self.pipe_max:  # a task's pages held in a few big pipes, not in chunks
            await asyncio.to_thread(ensure_pipe_max, self.pipe_max)
        args += workers
        for r in external_pages:
            args += [EXTERNAL_PAGES_FLAG, r]
        if mount_ns:
            args += [*external_mounts, *_MOUNT_NS_DUMP]
        hook = FrozenHook(on_frozen or nothing)
        env = self._env(hook.env())
        args += ["--action-script", str(hook.script)]
        hook.start()
        try:
            await self._run(args, log_path, "dump", time_limit, env, outlive_us=True)
        except CriuError:
            if hook.error is not None:
                raise hook.error from None
            raise
        finally:
            await hook.close()
        if not hook.called:
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
        manage_cgroups: str | None = None,
        shell_job: bool = False,
        log_file: Path | None = None,
        time_limit: float | None = None,
        mount_ns: bool = False,
        external_mounts: Sequence[str] = (),
        leave_stopped: bool = False,
    ) -> int:
        """Restore the tree in ``images_dir`` detached from us; returns the root's host pid
        (``leave_stopped``: every process left stopped, for the caller to continue).

        ``--tcp-established`` is always given: an image without connected TCP sockets is
        unaffected, one with them (the dump decided) cannot be restored without it.
        ``external_mounts``: where each host mount the image names comes from on this host
        (:func:`.mounts.plan`)."""
        work = workdirs.make("spotguard-restore-")
        log_path = log_file or (self.log_dir or work) / "criu-restore.log"
        pidfile = work / "pid"
        args = [
            "restore",
            "-D",
            str(images_dir),
            "-o",
            str(log_path),
            f"-v{self.log_level}",
            "--restore-detached",
            "--pidfile",
            str(pidfile),
            "--ext-unix-sk",
            "--file-locks",
            "--tcp-established",
        ]
        if stream:
            args.append("--stream")
        if manage_cgroups:
            args.append(f"--manage-cgroups={manage_cgroups}")
        if shell_job:
            args.append("--shell-job")
        args += ["--leave-stopped"] if leave_stopped else []
        args += self._plugin_args()
        args += await self.page_worker_args()
        if mount_ns:
            args += [*external_mounts, *_MOUNT_NS_RESTORE]
        try:
            await self._run(args, log_path, "restore", time_limit, self._env())
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
        *,
        outlive_us: bool = False,
    ) -> None:
        """Run CRIU and wait for it. ``outlive_us`` (a dump): CRIU in a session of its own
        and no parent-death signal, so that it unwinds the dump itself if we die (module
        doc); else it dies with us. Past the time limit, or cancelled, a restore's CRIU is
        killed; a dump's is left to unwind the dump (killed, its parasite may be left inside a
        task): the caller's failure makes it fail — the post-dump hook answers no, the stream
        is aborted — and the engine waits for it to let the tree go
        (:func:`.recovery.criu_let_go`), killing it only past that wait."""
        argv = [self.path, *args]
        log.debug("running criu", extra={"argv": argv})
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=outlive_us,
                preexec_fn=None if outlive_us else _die_with_parent,
            )
        except OSError as exc:
            raise CriuError(f"cannot run criu {what}: {exc}", argv=argv) from exc
        limit = time_limit if time_limit is not None else self.timeout
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), limit)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if not outlive_us:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await asyncio.shield(proc.wait())
            if isinstance(exc, asyncio.CancelledError):
                raise
            stopped = "left to unwind" if outlive_us else "stopped"
            raise StepTimeout(
                f"criu {what} ran past {limit:.0f} s and was {stopped}\n{log_tail(log_path)}"
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
