"""The one protocol a container runtime backend satisfies, and the runc wrapper they write.

spotguard drives each container runtime through one class: :class:`~spotguard.container.
podman.Podman` (``podman:NAME``), :class:`~spotguard.container.docker.Docker`
(``docker:NAME``) and :class:`~spotguard.container.containerd.Containerd`
(``containerd:NAMESPACE/ID``). Each satisfies :class:`ContainerRuntime`: the few things every
container checkpoint and restore needs from its runtime whatever the runtime is — its
version for the image's record, the CRIU it runs, its time limit, and writing spotguard's
runtime pieces (:func:`write_runtime_dir`). What differs (how a checkpoint is taken, what the
archive is) lives in each backend's own module; the commands pick the backend by the job's
runtime (``ContainerRef.runtime``, ``ContainerImage.runtime``).

:func:`write_runtime_dir` writes, in a root-only directory: ``runc`` — a wrapper that runs the
real runc with ``--criu <spotguard's CRIU>`` (4.2.1 with spotguard's patches) and CRIU's
configuration in ``CRIU_CONFIG_FILE``; ``criu.conf`` (``network-lock nftables``: the hosts
have no iptables); ``bin/criu`` linked to the same CRIU (runtimes that check CRIU's version
find it first on their ``PATH``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

from spotguard import safefs
from spotguard.errors import ContainerError, RuntimeCriuError

T = TypeVar("T")
log = logging.getLogger(__name__)

#: CRIU's configuration for every container spotguard checkpoints
CRIU_CONF = "network-lock nftables\n"


@runtime_checkable
class ContainerRuntime(Protocol):
    """A container runtime backend (podman, containerd)."""

    @property
    def criu(self) -> str:
        """The CRIU binary the runtime's runc is told to use."""
        ...

    @property
    def timeout(self) -> float:
        """Seconds one runtime command may take."""
        ...

    def prepare(self) -> None:
        """Write spotguard's runtime pieces (:func:`write_runtime_dir`); idempotent."""
        ...

    def criu_version(self) -> str:
        """CRIU's version, for the image's record."""
        ...

    async def version(self) -> str:
        """The runtime's version, for the image's record."""
        ...


def write_runtime_dir(runtime_dir: Path, runc: str, criu: str) -> Path:
    """Write the runc wrapper, the CRIU link and CRIU's configuration under ``runtime_dir``
    (each file replaced atomically, the directory root-only); the wrapper's path."""
    bindir = runtime_dir / "bin"
    safefs.ensure_private_dir(bindir)
    conf = runtime_dir / "criu.conf"
    wrapper = (
        "#!/bin/sh\n# runc with spotguard's CRIU (written by spotguard; see "
        "src/spotguard/container/runtime.py)\n"
        f"export CRIU_CONFIG_FILE={shell_quote(str(conf))}\n"
        f'exec {shell_quote(runc)} --criu {shell_quote(criu)} "$@"\n'
    )
    safefs.write_file(runtime_dir / "runc", wrapper.encode(), mode=0o700)
    safefs.write_file(conf, CRIU_CONF.encode(), mode=0o600)
    link = bindir / "criu"
    if not (link.is_symlink() and os.readlink(link) == criu):
        tmp = bindir / ".criu.new"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        tmp.symlink_to(criu)
        tmp.replace(link)
    return runtime_dir / "runc"


def shell_quote(text: str) -> str:
    """Single-quote ``text`` for /bin/sh."""
    return "'" + text.replace("'", "'\"'\"'") + "'"


def tail(text: str, lines: int = 6) -> str:
    """The last ``lines`` non-empty lines of a tool's output, on one line (error messages)."""
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(kept[-lines:])[:800]


def criu_errors(said: str) -> tuple[str, str] | None:
    """Where a runtime's failure names CRIU's log (runc through podman: "log file: PATH";
    through containerd: "path= PATH"), that log's path and its last error lines: the runtime
    removes the log with its work directory soon after, and its own message ("criu failed:
    type NOTIFY errno 0") does not say what CRIU refused."""
    m = re.search(r"(?:log file: |path= ?)(/\S+?\.log)", said)
    if m is None:
        return None
    try:
        lines = Path(m.group(1)).read_text(errors="replace").splitlines()
    except OSError:
        return None
    errors = [ln for ln in lines if "Error" in ln][-8:]
    return (m.group(1), " | ".join(errors)) if errors else None


def _log_criu_errors(said: str) -> tuple[str, str] | None:
    """:func:`criu_errors`, logged; returned too."""
    found = criu_errors(said)
    if found is not None:
        log.warning("CRIU's log says", extra={"path": found[0], "error": found[1]})
    return found


async def run_tool(
    argv: Sequence[str], *, env: dict[str, str] | None, limit: float, what: str, label: str
) -> str:
    """Run a runtime's CLI (podman, ctr, docker) with a time limit; its stdout. A tool that
    cannot start, runs past ``limit`` (killed) or fails is one :class:`ContainerError` line:
    ``what`` was being done, ``label`` (e.g. ``podman checkpoint``) and what the tool said."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
    except OSError as exc:
        raise ContainerError(f"{what}: cannot run {argv[0]}: {exc}") from exc
    try:
        out, err = await asyncio.wait_for(proc.communicate(), limit)
    except TimeoutError as exc:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise ContainerError(f"{what}: {label} ran past {limit:g}s") from exc
    if proc.returncode != 0:
        said = tail(err.decode(errors="replace")) or tail(out.decode(errors="replace"))
        log.warning(f"{label.split()[0]} failed",
                    extra={"argv": " ".join(argv), "status": proc.returncode})  # fmt: skip
        found = _log_criu_errors(f"{out.decode(errors='replace')}\n{err.decode(errors='replace')}")
        if "criu failed" in said.lower() or found is not None:
            why = f"; CRIU's log: {_reason(found[1])}" if found is not None else ""
            raise RuntimeCriuError(f"{what}: {label} failed: {said}{why}")
        raise ContainerError(f"{what}: {label} failed: {said}")
    return out.decode(errors="replace")


def _reason(errors: str) -> str:
    """CRIU's error lines without the summary ones that say nothing ("Dumping FAILED."),
    shortened for a one-line error."""
    lines = [e.strip() for e in errors.split(" | ")]
    kept = [e for e in lines if not e.rstrip(".").endswith("FAILED")] or lines
    return " | ".join(kept)[-400:]


#: how long a checkpoint whose CRIU failed waits before its one more try (seconds)
CRIU_RETRY_S = 1.0


async def once_more_if_criu_failed(call: Callable[[], Awaitable[T]], *, job: str) -> T:
    """``call()`` (a runtime's checkpoint), once more if the runtime's CRIU failed.

    A runtime's failed dump leaves the container running as it was, so trying again is safe;
    what fails it once under load (a process in D state past CRIU's seize timeout, seen
    right after a runtime restored a container in place) passes on the next try. Any other
    failure, and a second CRIU failure, is raised as it is."""
    try:
        return await call()
    except RuntimeCriuError as exc:
        log.warning(
            "the runtime's CRIU failed; checkpointing once more",
            extra={"job": job, "error": str(exc)},
        )
    await asyncio.sleep(CRIU_RETRY_S)
    return await call()
