"""Driving containerd: every ``ctr`` command spotguard runs goes through :class:`Containerd`.

What spotguard adds around ``ctr``, on every call:

* ``--address``: the containerd socket settings name (``[container] containerd_address``;
  the tests start their own daemon with its own root, state and socket).
* ``--namespace``: the container's (``containerd:NAMESPACE/ID``).
* For containers it starts (``spotguard run --container containerd:NS/ID``): ``--runc-binary``
  = a runc wrapper in ``containerd_runtime_dir`` that runs runc with ``--criu <spotguard's
  CRIU>`` and ``CRIU_CONFIG_FILE`` (``network-lock nftables``), written before each call
  (:func:`~spotguard.container.runtime.write_runtime_dir`). containerd keeps the wrapper's
  path in the container's runtime options, and a checkpoint carries them: the wrapper lives
  at the same path on every host, as podman's does.

The checkpoint archive (:data:`~spotguard.container.spec.CONTAINERD_ARCHIVE`) is an OCI image
layout that ``ctr images import`` takes: one index in containerd's container-checkpoint format
(``ctr containers restore`` reads it) built from what ``ctr tasks checkpoint`` wrote into the
content store — CRIU's tar, the OCI spec, the writable layer's diff — plus the container's
runtime options and the annotations naming its image, runtime and snapshotter
(:meth:`Containerd.export_layout`). Commands run as subprocesses with a time limit; a failure
is one :class:`ContainerError` line naming the command and the last thing ctr said.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any

from spotguard.checkpoint.criufind import find_criu, version_of
from spotguard.container.runtime import (
    once_more_if_criu_failed,
    run_tool,
    tail,
    write_runtime_dir,
)
from spotguard.container.settings import CONTAINERD_PREFIX, PREFIX, ContainerSettings
from spotguard.container.spec import ContainerRef
from spotguard.errors import ConfigError, ContainerError, ImageError

log = logging.getLogger(__name__)

#: containerd's media types of a container checkpoint (``ctr containers checkpoint``)
CRIU_TAR = "application/vnd.containerd.container.criu.checkpoint.criu.tar"
SPEC = "application/vnd.containerd.container.checkpoint.config.v1+proto"
RW_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
RUNTIME_OPTIONS = "application/vnd.containerd.container.checkpoint.runtime.options+proto"
INDEX = "application/vnd.oci.image.index.v1+json"
REF_NAME = "org.opencontainers.image.ref.name"
#: the annotations ``ctr containers restore`` reads from a checkpoint's index
RUNTIME_LABEL = "io.containerd.checkpoint.runtime"
SNAPSHOTTER_LABEL = "io.containerd.checkpoint.snapshotter"
#: what a checkpoint index may hold, at most (its children are the blobs above)
MAX_INDEX_BYTES = 1 << 20
MAX_SPEC_BYTES = 16 << 20
#: containerd's task states as podman names them
TASK_STATES = {
    "RUNNING": "running",
    "PAUSED": "paused",
    "PAUSING": "paused",
    "STOPPED": "exited",
    "CREATED": "created",
}
#: the annotation runc reads for a container's own CRIU configuration file
CRIU_CONFIG_ANNOTATION = "org.criu.config"


def _find(explicit: str | None, name: str, candidates: list[str]) -> str:
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ConfigError(f"{name} {explicit!r} is not an executable (setting [container])")
        return explicit
    for cand in candidates:
        if cand and os.access(cand, os.X_OK):
            return cand
    raise ConfigError(
        f"no {name} found ({', '.join(c for c in candidates if c)}): run "
        f"scripts/install-containerd (or set SPOTGUARD_CONTAINER_{name.upper()})"
    )


def _varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def _field(number: int, data: bytes) -> bytes:
    """One length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Containerd:
    """One containerd (its socket), the ctr that talks to it, spotguard's runc wrapper."""

    ctr: str
    address: Path
    runc: str
    criu: str
    runtime_dir: Path = Path("/run/spotguard/containerd")
    timeout: float = 600.0
    hosts_dir: Path = Path("/etc/containerd/certs.d")

    @classmethod
    def from_settings(cls, s: ContainerSettings, *, criu: str | None = None) -> Containerd:
        """The ctr, socket, runc and CRIU to use (CRIU: ``criu`` or spotguard's search)."""
        prefixed = str(CONTAINERD_PREFIX / "bin" / "ctr")
        ctr = _find(s.ctr, "ctr", [shutil.which("ctr") or "", prefixed])
        runcs = [str(CONTAINERD_PREFIX / "bin" / "runc"), str(PREFIX / "bin" / "runc")]
        return cls(
            ctr=ctr,
            address=s.containerd_address,
            runc=_find(s.runc, "runc", [*runcs, shutil.which("runc") or ""]),
            criu=find_criu(criu),
            runtime_dir=s.containerd_runtime_dir,
            timeout=s.timeout,
            hosts_dir=s.containerd_hosts_dir,
        )

    # --- spotguard's runtime pieces ---------------------------------------------------------
    @property
    def runtime(self) -> Path:
        """The runc wrapper containerd's shim runs (``ctr run --runc-binary``)."""
        return self.runtime_dir / "runc"

    def prepare(self) -> None:
        """Write the runc wrapper, the CRIU link and CRIU's configuration (idempotent)."""
        write_runtime_dir(self.runtime_dir, self.runc, self.criu)

    def runtime_options(self) -> bytes:
        """The runc shim's options naming the wrapper, as containerd stores them: a protobuf
        ``Any`` of ``containerd.runc.v1.Options`` whose ``binary_name`` (field 6) is set."""
        options = _field(6, str(self.runtime).encode())
        return _field(1, b"containerd.runc.v1.Options") + _field(2, options)

    def registry_args(self) -> list[str]:
        """``--hosts-dir DIR`` for pulls and pushes where the registry configuration exists
        (ctr, unlike the daemon's CRI, reads none unless told)."""
        return ["--hosts-dir", str(self.hosts_dir)] if self.hosts_dir.is_dir() else []

    def argv(self, namespace: str, *args: str) -> list[str]:
        return [self.ctr, "--address", str(self.address), "--namespace", namespace, *args]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{self.runtime_dir / 'bin'}:{env.get('PATH', '/usr/sbin:/usr/bin')}"
        return env

    # --- running ctr --------------------------------------------------------------------------
    async def run(
        self, *args: str, what: str, namespace: str = "default", limit_s: float | None = None
    ) -> str:
        """Run ``ctr ARGS`` in ``namespace``; its stdout. Failure, a time-out or no ctr:
        ContainerError (``what`` says what was being done)."""
        await asyncio.to_thread(self.prepare)
        argv = self.argv(namespace, *args)
        limit = self.timeout if limit_s is None else limit_s
        return await run_tool(
            argv, env=self.env(), limit=limit, what=what, label=f"ctr {' '.join(args[:2])}"
        )

    async def checkpoint_task(self, ref: ContainerRef, *, leave_running: bool) -> str:
        """``ctr tasks checkpoint [--exit] ID``; its output (the checkpoint image's name last).
        Tried once more if runc's CRIU failed: the task ran on
        (:func:`~spotguard.container.runtime.once_more_if_criu_failed`)."""
        args = ["tasks", "checkpoint", *(() if leave_running else ("--exit",)), ref.name]
        what = f"checkpointing {ref}"
        run = partial(self.run, *args, namespace=ref.namespace, what=what)
        return await once_more_if_criu_failed(run, job=ref.job)

    async def version(self) -> str:
        """The daemon's version (``ctr version``, its Server part)."""
        out = await self.run("version", what="containerd version")
        server = out.partition("Server:")[2]
        for line in server.splitlines():
            key, _, value = line.strip().partition(":")
            if key == "Version":
                return value.strip()
        raise ContainerError("ctr version does not name the daemon's version")

    def criu_version(self) -> str:
        return version_of(self.criu) or "unknown"

    async def exists(self, ref: ContainerRef) -> bool:
        """Whether containerd knows the container ``ref`` (``ctr containers ls -q``)."""
        out = await self.run("containers", "ls", "-q", namespace=ref.namespace, what="listing")
        return ref.name in out.split()

    async def info(self, ref: ContainerRef) -> dict[str, Any] | None:
        """``ctr containers info``, or None when there is no such container."""
        if not await self.exists(ref):
            return None
        out = await self.run(
            "containers", "info", ref.name, namespace=ref.namespace, what=f"inspecting {ref}"
        )
        try:
            data = json.loads(out)
        except ValueError as exc:
            raise ContainerError(f"ctr's answer about {ref} is not JSON") from exc
        if not isinstance(data, dict):
            raise ContainerError(f"ctr's answer about {ref} is not an object")
        return data

    async def task(self, ref: ContainerRef) -> tuple[str, int]:
        """The container's task: (status — RUNNING, PAUSED, STOPPED…, or "" when it has
        none —, its init pid)."""
        out = await self.run("tasks", "ls", namespace=ref.namespace, what="listing tasks")
        for line in out.splitlines()[1:]:
            cols = line.split()
            if len(cols) >= 3 and cols[0] == ref.name:
                return cols[2], int(cols[1]) if cols[1].isdigit() else 0
        return "", 0

    async def inspect(self, ref: ContainerRef) -> dict[str, Any] | None:
        """The container's state in the shape of ``podman container inspect`` (what the
        agent's guard and park read): ``{"Id": ID, "State": {"Status": running | paused |
        exited | created, "Pid": N}}``; None when there is no such container."""
        if not await self.exists(ref):
            return None
        status, pid = await self.task(ref)
        mapped = TASK_STATES.get(status, status.lower() or "created")
        live = mapped in ("running", "paused")
        return {"Id": ref.name, "State": {"Status": mapped, "Pid": pid if live else 0}}

    async def images(self, namespace: str) -> dict[str, str]:
        """The namespace's images: name → target digest (``ctr images ls``)."""
        out = await self.run("images", "ls", namespace=namespace, what="listing images")
        found: dict[str, str] = {}
        for line in out.splitlines()[1:]:
            cols = line.split()
            if len(cols) >= 3 and cols[2].startswith("sha256:"):
                found[cols[0]] = cols[2]
        return found

    async def remove_image(self, namespace: str, name: str) -> None:
        """``ctr images rm --sync``: its content is collected before this returns (a blob
        left for containerd's later collection makes the container's next checkpoint fail:
        :mod:`.ctrspec`); a failure is logged, never raised: the image is spotguard's own
        scratch."""
        try:
            await self.run(
                "images", "rm", "--sync", name, namespace=namespace, what=f"removing {name}"
            )
        except ContainerError as exc:
            log.warning("checkpoint image not removed", extra={"image": name, "error": str(exc)})

    # --- the checkpoint archive ---------------------------------------------------------------
    async def read_blob(self, namespace: str, digest: str, limit: int) -> bytes:
        """A small blob of the content store (an index, a spec), at most ``limit`` bytes."""
        out = await asyncio.to_thread(self._blob_bytes, namespace, digest, limit)
        return out

    def _blob_bytes(self, namespace: str, digest: str, limit: int) -> bytes:
        buf = io.BytesIO()
        self._copy_blob(namespace, digest, buf, limit)
        return buf.getvalue()

    def _copy_blob(self, namespace: str, digest: str, out: IO[bytes], size: int) -> int:
        """``ctr content get DIGEST`` into ``out`` (at most ``size`` bytes)."""
        proc = subprocess.Popen(
            self.argv(namespace, "content", "get", digest),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env(),
        )
        assert proc.stdout is not None and proc.stderr is not None
        copied = 0
        try:
            while chunk := proc.stdout.read(min(1 << 20, size + 1 - copied)):
                copied += len(chunk)
                if copied > size:
                    raise ContainerError(f"blob {digest[:19]} is larger than {size} bytes")
                out.write(chunk)
            err = proc.stderr.read()
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            status = proc.wait(self.timeout)
        if status != 0:
            said = tail(err.decode(errors="replace"))
            raise ContainerError(f"ctr content get {digest[:19]} failed: {said}")
        return copied

    async def export_layout(
        self, ref: ContainerRef, checkpoint: str, info: dict[str, Any], dest: Path, name: str
    ) -> None:
        """Write to ``dest`` the OCI layout that restores the task checkpoint image
        ``checkpoint`` (``ctr tasks checkpoint``'s) of the container ``ref`` (``info``: its
        ``ctr containers info``) as a container checkpoint named ``name``."""
        images = await self.images(ref.namespace)
        if checkpoint not in images:
            raise ContainerError(f"the checkpoint image {checkpoint} of {ref} is not there")
        raw = await self.read_blob(ref.namespace, images[checkpoint], MAX_INDEX_BYTES)
        try:
            children = json.loads(raw)["manifests"]
            wanted = [d for d in children if d["mediaType"] in (CRIU_TAR, SPEC, RW_LAYER)]
        except (ValueError, KeyError, TypeError) as exc:
            raise ContainerError(f"the checkpoint index of {ref} is not understood") from exc
        kinds = sorted(d["mediaType"] for d in wanted)
        if kinds != sorted((CRIU_TAR, SPEC, RW_LAYER)):
            raise ContainerError(f"the checkpoint of {ref} lacks a part: it holds {kinds}")
        options = self.runtime_options()
        runtime = info.get("Runtime") or {}
        index = {
            "schemaVersion": 2,
            "manifests": [
                {"mediaType": RUNTIME_OPTIONS, "digest": _digest(options), "size": len(options)},
                *wanted,
            ],
            "annotations": {
                REF_NAME: str(info.get("Image") or ""),
                RUNTIME_LABEL: str(runtime.get("Name") or "io.containerd.runc.v2"),
                SNAPSHOTTER_LABEL: str(info.get("Snapshotter") or "overlayfs"),
            },
        }
        index_bytes = json.dumps(index).encode()
        top = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": INDEX,
                    "digest": _digest(index_bytes),
                    "size": len(index_bytes),
                    "annotations": {REF_NAME: name},
                }
            ],
        }
        await asyncio.to_thread(
            self._write_layout, ref.namespace, dest, wanted, options, index_bytes, top
        )

    def _write_layout(
        self,
        namespace: str,
        dest: Path,
        blobs: list[dict[str, Any]],
        options: bytes,
        index: bytes,
        top: dict[str, Any],
    ) -> None:
        with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tar:
            _add(tar, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
            _add(tar, blob_path(_digest(options)), options)
            for d in blobs:
                self._blob_into(tar, namespace, str(d["digest"]), int(d["size"]))
            _add(tar, blob_path(_digest(index)), index)
            _add(tar, "index.json", json.dumps(top).encode())

    def _blob_into(self, tar: tarfile.TarFile, namespace: str, digest: str, size: int) -> None:
        """``ctr content get DIGEST`` as the layout's member for that blob, streamed (a CRIU
        tar may be gigabytes): exactly ``size`` bytes, or ContainerError."""
        proc = subprocess.Popen(
            self.argv(namespace, "content", "get", digest),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env(),
        )
        assert proc.stdout is not None and proc.stderr is not None
        try:
            try:
                tar.addfile(_info(blob_path(digest), size), proc.stdout)
            except OSError as exc:  # tarfile: "unexpected end of data"
                raise ContainerError(f"blob {digest[:19]} is shorter than {size} bytes") from exc
            if proc.stdout.read(1):
                raise ContainerError(f"blob {digest[:19]} is longer than {size} bytes")
            err = proc.stderr.read()
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            status = proc.wait(self.timeout)
        if status != 0:
            raise ContainerError(f"ctr content get {digest[:19]} failed: {tail(err.decode())}")

    async def import_layout(self, namespace: str, layout: Path) -> str:
        """``ctr images import --no-unpack`` of a checkpoint layout; the checkpoint's name."""
        name = await asyncio.to_thread(layout_name, layout)
        await self.run(
            "images", "import", "--no-unpack", str(layout),
            namespace=namespace, what=f"importing the checkpoint {name}",
        )  # fmt: skip
        return name


def blob_path(digest: str) -> str:
    """A blob's path in an OCI layout (``blobs/ALGO/HEX``)."""
    algo, _, hexa = digest.partition(":")
    return f"blobs/{algo}/{hexa}"


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o600, int(time.time())
    return info


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(_info(name, len(data)), io.BytesIO(data))


def layout_name(layout: Path) -> str:
    """The checkpoint's name in a layout's ``index.json`` (ImageError if it has none)."""
    try:
        with tarfile.open(layout, "r:") as tar:
            member = tar.getmember("index.json")
            f = tar.extractfile(member)
            top = json.loads(f.read(MAX_INDEX_BYTES) if f is not None else b"")
        return str(top["manifests"][0]["annotations"][REF_NAME])
    except (tarfile.TarError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ImageError(f"{layout.name} is not a containerd checkpoint layout: {exc}") from exc
