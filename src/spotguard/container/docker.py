"""Driving docker: every ``docker`` command spotguard runs goes through :class:`Docker`.

What spotguard adds around docker, on every call:

* ``-H``: the daemon settings name (``[container] docker_host``; the tests start their own
  dockerd with its own data root, exec root and socket).
* The runc wrapper (runc with ``--criu <spotguard's CRIU>`` and ``CRIU_CONFIG_FILE`` =
  ``network-lock nftables``) written to ``<docker_runtime_dir>/runc`` before each call. dockerd
  takes no runtime path per command: the daemon must have a runtime entry naming the wrapper
  (``dockerd --add-runtime spotguard=/run/spotguard/docker/runc``, or ``daemon.json``
  ``"runtimes"``) and be ``--experimental`` (``docker checkpoint`` is experimental in 20.10);
  containers spotguard starts or restores run with ``--runtime <docker_runtime>``.

Commands run as subprocesses with a time limit; a failure is one :class:`ContainerError` line
naming the command and the last thing docker said.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard.checkpoint.criufind import find_criu, version_of
from spotguard.container.runtime import (
    once_more_if_criu_failed,
    run_tool,
    tail,
    write_runtime_dir,
)
from spotguard.container.settings import CONTAINERD_PREFIX, DOCKER_PREFIX, PREFIX, ContainerSettings
from spotguard.errors import ConfigError, ContainerError

log = logging.getLogger(__name__)


def _find(explicit: str | None, name: str, candidates: list[str]) -> str:
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ConfigError(f"{name} {explicit!r} is not an executable (setting [container])")
        return explicit
    for cand in candidates:
        if cand and os.access(cand, os.X_OK):
            return cand
    raise ConfigError(
        f"no {name} found ({', '.join(c for c in candidates if c)}): run scripts/install-docker "
        f"(or set SPOTGUARD_CONTAINER_{name.upper()})"
    )


@dataclass(frozen=True)
class Docker:
    """One docker daemon (its socket), the docker CLI that talks to it, the runc wrapper."""

    binary: str
    host: str
    runc: str
    criu: str
    runtime_name: str = "spotguard"
    runtime_dir: Path = Path("/run/spotguard/docker")
    timeout: float = 600.0

    @classmethod
    def from_settings(cls, s: ContainerSettings, *, criu: str | None = None) -> Docker:
        """The docker, daemon, runc and CRIU to use (CRIU: ``criu`` or spotguard's search)."""
        binary = _find(
            s.docker,
            "docker",
            [shutil.which("docker") or "", str(DOCKER_PREFIX / "bin" / "docker")],
        )
        runcs = [str(CONTAINERD_PREFIX / "bin" / "runc"), str(PREFIX / "bin" / "runc")]
        return cls(
            binary=binary,
            host=s.docker_host,
            runc=_find(s.runc, "runc", [*runcs, shutil.which("runc") or ""]),
            criu=find_criu(criu),
            runtime_name=s.docker_runtime,
            runtime_dir=s.docker_runtime_dir,
            timeout=s.timeout,
        )

    @property
    def runtime(self) -> Path:
        """The runc wrapper the daemon's runtime entry must name."""
        return self.runtime_dir / "runc"

    def prepare(self) -> None:
        """Write the runc wrapper, the CRIU link and CRIU's configuration (idempotent)."""
        write_runtime_dir(self.runtime_dir, self.runc, self.criu)

    def argv(self, *args: str) -> list[str]:
        return [self.binary, "-H", self.host, *args]

    def criu_version(self) -> str:
        return version_of(self.criu) or "unknown"

    async def run(self, *args: str, what: str, limit_s: float | None = None) -> str:
        """Run ``docker ARGS``; its stdout. Failure, a time-out or no docker: ContainerError
        (``what`` says what was being done)."""
        await asyncio.to_thread(self.prepare)
        argv = self.argv(*args)
        limit = self.timeout if limit_s is None else limit_s
        return await run_tool(
            argv, env=None, limit=limit, what=what, label=f"docker {' '.join(args[:2])}"
        )

    async def checkpoint(self, container: str, job: str, into: Path, name: str) -> None:
        """``docker checkpoint create --checkpoint-dir INTO CONTAINER NAME``: the checkpoint
        in ``INTO/NAME``. Tried once more if runc's CRIU failed (the container ran on: see
        :func:`~spotguard.container.runtime.once_more_if_criu_failed`), a failed try's
        partial checkpoint removed first."""

        async def create() -> str:
            await asyncio.to_thread(shutil.rmtree, into / name, True)
            return await self.run(
                "checkpoint", "create", "--checkpoint-dir", str(into), container, name,
                what=f"checkpointing docker:{container}",
            )  # fmt: skip

        await once_more_if_criu_failed(create, job=job)

    async def inspect_object(self, kind: str, name: str) -> dict[str, Any] | None:
        """``docker KIND inspect NAME``; None when docker knows no such object."""
        await asyncio.to_thread(self.prepare)
        proc = await asyncio.create_subprocess_exec(
            *self.argv(kind, "inspect", name),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), self.timeout)
        if proc.returncode != 0:
            said = err.decode(errors="replace")
            if "No such" in said:
                return None
            raise ContainerError(f"docker {kind} inspect {name} failed: {tail(said)}")
        try:
            data = json.loads(out)
        except ValueError as exc:
            raise ContainerError(f"docker's answer about {name} is not JSON") from exc
        if not isinstance(data, list) or not data or not isinstance(data[0], dict):
            raise ContainerError(f"docker's answer about {name} is empty")
        return data[0]

    async def inspect(self, name: str) -> dict[str, Any] | None:
        """``docker container inspect NAME``, or None when no such container exists."""
        return await self.inspect_object("container", name)

    async def image_inspect(self, ref: str) -> dict[str, Any] | None:
        """``docker image inspect REF``, or None when this host does not have it."""
        return await self.inspect_object("image", ref)

    async def version(self) -> str:
        out = await self.run("version", "--format", "{{.Server.Version}}", what="docker version")
        return out.strip()

    async def root_dir(self) -> Path:
        """The daemon's data root (``docker info``): where its containers' checkpoints live."""
        out = await self.run("info", "--format", "{{.DockerRootDir}}", what="docker info")
        root = out.strip()
        if not root.startswith("/"):
            raise ContainerError(f"docker info names no data root ({root!r})")
        return Path(root)
