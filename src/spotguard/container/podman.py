"""Driving podman: every podman command spotguard runs goes through :class:`Podman`.

What spotguard adds around podman, on every call:

* ``--runtime``: a small runc wrapper in ``runtime_dir`` that runs runc with
  ``--criu <spotguard's CRIU>`` (4.2.1 with spotguard's patches), and ``PATH`` starting with a
  directory whose ``criu`` is the same binary (podman checks CRIU's version itself). The
  wrapper lives at the same path on every host (``/run/spotguard/podman``, rewritten before
  each call) because a restored container names its runtime.
* ``--root`` / ``--runroot`` (and ``--tmpdir`` beside the runroot) when settings give them: a
  host's own podman storage is used only where the operator says so.
* CRIU's configuration ``<runtime_dir>/criu.conf`` (``network-lock nftables``; iptables is
  not installed here) reaches CRIU twice: as ``CRIU_CONFIG_FILE`` in the runc wrapper's
  environment (every container, however it was started), and as the annotation
  ``org.criu.config`` on containers ``spotguard run --container`` starts (runc hands it to
  CRIU itself).

Commands run as subprocesses with a time limit; a failure is one :class:`ContainerError` line
naming the command and the last thing podman said.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard.checkpoint.criufind import find_criu, version_of
from spotguard.container.runtime import run_tool, tail, write_runtime_dir
from spotguard.container.settings import PREFIX, ContainerSettings
from spotguard.errors import ConfigError, ContainerError

log = logging.getLogger(__name__)

#: the annotation runc (and crun) read for a container's own CRIU configuration file
CRIU_CONFIG_ANNOTATION = "org.criu.config"


def _find(explicit: str | None, name: str, prefixed: Path) -> str:
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ConfigError(f"{name} {explicit!r} is not an executable (setting [container])")
        return explicit
    for cand in (shutil.which(name), str(prefixed)):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise ConfigError(
        f"no {name} found (PATH or {prefixed}): run scripts/install-podman "
        f"(or set SPOTGUARD_CONTAINER_{name.upper()})"
    )


@dataclass(frozen=True)
class Podman:
    """One podman installation and storage, with spotguard's runtime wrapper and CRIU."""

    binary: str
    runc: str
    criu: str
    root: Path | None = None
    runroot: Path | None = None
    runtime_dir: Path = Path("/run/spotguard/podman")
    timeout: float = 600.0
    extra_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, s: ContainerSettings, *, criu: str | None = None) -> Podman:
        """The podman, runc and CRIU to use (CRIU: ``criu`` or spotguard's search)."""
        prefix = Path(s.podman).parent.parent if s.podman else PREFIX
        return cls(
            binary=_find(s.podman, "podman", PREFIX / "bin" / "podman"),
            runc=_find(s.runc, "runc", prefix / "bin" / "runc"),
            criu=find_criu(criu),
            root=s.root,
            runroot=s.runroot,
            runtime_dir=s.runtime_dir,
            timeout=s.timeout,
        )

    # --- spotguard's runtime pieces ---------------------------------------------------------
    @property
    def runtime(self) -> Path:
        return self.runtime_dir / "runc"

    @property
    def criu_conf(self) -> Path:
        return self.runtime_dir / "criu.conf"

    def prepare(self) -> None:
        """Write the runc wrapper, the CRIU link and CRIU's configuration (idempotent, each
        file replaced atomically, in a root-only directory: runtime.write_runtime_dir)."""
        write_runtime_dir(self.runtime_dir, self.runc, self.criu)

    def argv(self, *args: str) -> list[str]:
        """podman's command line: the global options, then ``args``."""
        out = [self.binary]
        if self.root is not None:
            out += ["--root", str(self.root)]
        if self.runroot is not None:
            out += ["--runroot", str(self.runroot), "--tmpdir", str(self.runroot / "libpod-tmp")]
        out += ["--runtime", str(self.runtime), *args]
        return out

    def env(self) -> dict[str, str]:
        """podman's environment: ours, with spotguard's CRIU first on PATH."""
        env = dict(os.environ)
        env["PATH"] = f"{self.runtime_dir / 'bin'}:{env.get('PATH', '/usr/sbin:/usr/bin')}"
        env.update(self.extra_env)
        return env

    # --- running podman ---------------------------------------------------------------------
    async def run(self, *args: str, what: str, limit_s: float | None = None) -> str:
        """Run ``podman ARGS``; its stdout. Failure, a time-out or no podman: ContainerError
        (``what`` says what was being done)."""
        await asyncio.to_thread(self.prepare)
        argv = self.argv(*args)
        limit = self.timeout if limit_s is None else limit_s
        return await run_tool(
            argv, env=self.env(), limit=limit, what=what, label=f"podman {' '.join(args[:2])}"
        )

    async def checkpoint(self, name: str, *options: str, what: str) -> None:
        """``podman container checkpoint NAME OPTIONS``."""
        await self.run("container", "checkpoint", name, *options, what=what)

    async def inspect(self, name: str) -> dict[str, Any] | None:
        """``podman container inspect NAME``, or None when no such container exists."""
        if not await self.exists("container", name):
            return None
        data = await self.run("container", "inspect", name, what=f"inspecting {name}")
        return _one(data, f"container {name}")

    async def image_inspect(self, ref: str) -> dict[str, Any] | None:
        """``podman image inspect REF``, or None when this host does not have it."""
        if not await self.exists("image", ref):
            return None
        return _one(await self.run("image", "inspect", ref, what=f"inspecting {ref}"), ref)

    async def exists(self, kind: str, name: str) -> bool:
        """``podman KIND exists NAME`` (container, image, volume): 0 yes, 1 no."""
        await asyncio.to_thread(self.prepare)
        proc = await asyncio.create_subprocess_exec(
            *self.argv(kind, "exists", name),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=self.env(),
        )
        _, err = await asyncio.wait_for(proc.communicate(), self.timeout)
        if proc.returncode in (0, 1):
            return proc.returncode == 0
        said = tail(err.decode(errors="replace"))
        raise ContainerError(f"podman {kind} exists {name} failed: {said}")

    async def version(self) -> str:
        out = await self.run("version", "--format", "{{.Client.Version}}", what="podman version")
        return out.strip()

    async def storage_roots(self) -> tuple[str, str]:
        """podman's (graph root, run root) as it reports them."""
        out = await self.run("info", "--format", "json", what="podman info")
        try:
            store = json.loads(out)["store"]
            return str(store["graphRoot"]), str(store["runRoot"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ContainerError("podman info does not name its storage roots") from exc

    def criu_version(self) -> str:
        return version_of(self.criu) or "unknown"


def _one(text: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ContainerError(f"podman's answer about {what} is not JSON") from exc
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise ContainerError(f"podman's answer about {what} is empty")
    return data[0]
