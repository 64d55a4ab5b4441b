"""``spotguard-image.json``: what an image holds besides CRIU's files.

Written into the images directory at the end of a dump (the image engineer's manifest carries
it along); read by restore's preflight. Holds the job, the mode, the timeline, the GPUs the
job used and the host's facts, the CRIU version, the staging choice, the carried files and
the host mounts of the job's namespace (which of them it uses).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard import safefs
from spotguard.errors import ImageError, ImageNotFound, UnsafePath
from spotguard.facts import GpuInventory, HostFacts
from spotguard.modes import Mode
from spotguard.names import check_job_name

from .cpupages import PREFIX as CPU_PREFIX
from .files import CapturedFile
from .gpupages import PREFIX, GpuPages
from .mounts import JobMount

META_NAME = "spotguard-image.json"
#: 2: carried files record open_for_writing, uid and gid; 3: host mounts; 4: GPU memory
#: carried beside CRIU (``gpu_pages``); 5: the job's own memory carried beside CRIU
#: (``cpu_pages``; an image without it is still written as 4, so older spotguards read it)
META_SCHEMA = 5
#: the schema an image without ``cpu_pages`` is written as
_SCHEMA_WITHOUT_CPU_PAGES = 4
MAX_META_BYTES = 64 << 20


@dataclass
class ImageMeta:
    """Everything restore needs to know about an image that CRIU's own files do not say."""

    job: dict[str, Any]
    mode: Mode  # the file holds its string (``exit`` / ``resume``), as it always has
    criu_version: str
    host: HostFacts
    gpu: GpuInventory
    gpu_processes: list[int]  # namespace pids of the processes that held GPU state
    root_ns_pid: int
    pids: list[int]  # namespace pids of every process of the tree (root first)
    staging: dict[str, Any]
    timeline: list[dict[str, Any]]
    files: list[CapturedFile] = field(default_factory=list)
    #: the tree had its own mount namespace (private /proc): restore rebuilds it
    mount_ns: bool = False
    #: the host mounts of its namespace, named for CRIU, and whether the job uses each
    #: (:mod:`.mounts`); empty in older images (CRIU's own detection then)
    mounts: list[JobMount] = field(default_factory=list)
    #: the local ports of its listening TCP sockets, when it shared the host's network
    #: namespace (restore clears TIME_WAIT connections off them); empty in older images
    listen_ports: list[int] = field(default_factory=list)
    #: the GPU memory the driver staged, copied by spotguard beside CRIU's files
    #: (:mod:`.gpupages`); empty in older images and where CRIU moved it
    gpu_pages: list[GpuPages] = field(default_factory=list)
    #: the job's own large private memory, copied by spotguard beside CRIU's files
    #: (:mod:`.cpupages`); empty in older images and where CRIU moved it
    cpu_pages: list[GpuPages] = field(default_factory=list)
    schema: int = META_SCHEMA

    def to_json(self) -> dict[str, Any]:
        # an older spotguard must refuse an image whose memory it would leave out
        schema = META_SCHEMA if self.cpu_pages else min(self.schema, _SCHEMA_WITHOUT_CPU_PAGES)
        return {
            "schema": schema,
            "job": self.job,
            "mode": self.mode,
            "criu_version": self.criu_version,
            "host": self.host.to_json(),
            "gpu": self.gpu.to_json(),
            "gpu_processes": self.gpu_processes,
            "root_ns_pid": self.root_ns_pid,
            "pids": self.pids,
            "staging": self.staging,
            "timeline": self.timeline,
            "files": [f.to_json() for f in self.files],
            "mount_ns": self.mount_ns,
            "mounts": [m.to_json() for m in self.mounts],
            "listen_ports": self.listen_ports,
            "gpu_pages": [g.to_json() for g in self.gpu_pages],
            "cpu_pages": [g.to_json() for g in self.cpu_pages],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ImageMeta:
        """Parse the metadata; the job's name must be a valid job name (it names directories
        on the restoring host), the mode a :class:`Mode` and every carried file entry
        well-formed (``ValueError`` otherwise: :meth:`read` makes it an :class:`ImageError`)."""
        job = d["job"]
        if not isinstance(job, dict) or not isinstance(job.get("name"), str):
            raise ImageError(f"image metadata names no job: {job!r}")
        try:
            check_job_name(job["name"])
        except ValueError as exc:
            raise ImageError(f"image metadata: {exc}") from exc
        gpu_pages = _carried(d.get("gpu_pages", []), d.get("gpu_processes", []), PREFIX)
        cpu_pages = _carried(d.get("cpu_pages", []), d.get("pids", []), CPU_PREFIX)
        _apart(gpu_pages, cpu_pages)
        return cls(
            job=d["job"],
            mode=Mode(d["mode"]),
            criu_version=d["criu_version"],
            host=HostFacts.from_json(d["host"]),
            gpu=GpuInventory.from_json(d.get("gpu")),
            gpu_processes=[int(p) for p in d.get("gpu_processes", [])],
            root_ns_pid=int(d.get("root_ns_pid", 1)),
            pids=[int(p) for p in d.get("pids", [])],
            staging=d.get("staging", {}),
            timeline=d.get("timeline", []),
            files=[CapturedFile.from_json(f) for f in d.get("files", [])],
            mount_ns=bool(d.get("mount_ns", False)),
            mounts=[JobMount.from_json(m) for m in d.get("mounts", [])],
            listen_ports=[_port(p) for p in d.get("listen_ports", [])],
            gpu_pages=gpu_pages,
            cpu_pages=cpu_pages,
            schema=_schema(d.get("schema", META_SCHEMA)),
        )

    def write(self, images_dir: Path) -> Path:
        """Write the metadata atomically (0600) relative to the images directory's fd, never
        through a link (:func:`spotguard.safefs.write_file`)."""
        path = images_dir / META_NAME
        safefs.write_file(path, (json.dumps(self.to_json(), indent=2) + "\n").encode())
        return path

    @classmethod
    def read(cls, images_dir: Path) -> ImageMeta:
        """The metadata of the image in ``images_dir`` (a regular file of at most 64 MiB, not
        followed if a link); anything unreadable or malformed is an :class:`ImageError`."""
        path = images_dir / META_NAME
        real = Path(os.path.realpath(Path(os.path.abspath(images_dir)).parent)) / path.parent.name
        try:
            dfd = safefs.open_dir_nofollow(real)
            try:
                data = safefs.read_at(dfd, META_NAME, limit=MAX_META_BYTES)
            finally:
                os.close(dfd)
            return cls.from_json(json.loads(data))
        except FileNotFoundError as exc:
            msg = f"{images_dir} holds no {META_NAME}: not a spotguard image"
            raise ImageNotFound(msg) from exc
        except (OSError, ValueError, KeyError, TypeError, RecursionError, UnsafePath) as exc:
            raise ImageError(f"{path} is unreadable: {str(exc)[:200]}") from exc


def _schema(value: object) -> int:
    """The image's schema; a newer one than this spotguard knows is refused (it may carry
    state this version would silently leave out, such as GPU memory beside CRIU's files)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"schema: {value!r} is not a number")
    if value > META_SCHEMA:
        raise ValueError(
            f"image schema {value} is newer than this spotguard reads ({META_SCHEMA}): "
            "upgrade spotguard on this host"
        )
    return value


def _carried(raw: object, owners_raw: object, prefix: str) -> list[GpuPages]:
    """The ranges carried beside CRIU of one kind (``prefix``: the GPU memory staged, of a
    GPU process; the job's own, of a process of the tree), none overlapping another of its
    process, every part named once."""
    what = "gpu_pages" if prefix == PREFIX else "cpu_pages"
    if not isinstance(raw, list) or len(raw) > 1024:
        raise ValueError(f"{what}: not a list")
    pages = [GpuPages.from_json(g, prefix) for g in raw]
    owners = set(owners_raw) if isinstance(owners_raw, list) else set()
    seen: dict[int, list[tuple[int, int]]] = {}
    names: set[str] = set()
    for g in pages:
        if g.ns_pid not in owners:
            held = "held no GPU state" if prefix == PREFIX else "is not a process of the image"
            raise ValueError(f"{what}: pid {g.ns_pid} {held}")
        for lo, hi in seen.get(g.ns_pid, []):
            if g.start < hi and lo < g.end:
                raise ValueError(f"{what}: ranges of pid {g.ns_pid} overlap")
        seen.setdefault(g.ns_pid, []).append((g.start, g.end))
        for p in g.parts:
            if p.name in names:
                raise ValueError(f"{what}: part {p.name} named twice")
            names.add(p.name)
    return pages


def _apart(gpu: list[GpuPages], cpu: list[GpuPages]) -> None:
    """No range of the job's own memory overlaps one of the GPU memory staged: restore
    writes both back, and one must not write over the other."""
    for c in cpu:
        for g in gpu:
            if g.ns_pid == c.ns_pid and g.start < c.end and c.start < g.end:
                raise ValueError(f"cpu_pages: a range of pid {c.ns_pid} overlaps its gpu_pages")


def _port(value: object) -> int:
    """A TCP port from the image's metadata (``ValueError`` if it is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ValueError(f"listen_ports: {value!r} is not a TCP port")
    return value
