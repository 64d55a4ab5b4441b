"""What a container job is (``podman:NAME``) and what its image records about it.

A container image holds the runtime's own checkpoint archive (``podman container checkpoint
--export``: CRIU's files, the writable layer, podman's config) as one file, and in the
manifest's ``meta`` (authenticated with the manifest) the typed :class:`ContainerImage`: the
container's config as podman reported it before the checkpoint — image reference and ID,
env, mounts, devices, network mode, limits — which restore checks against the target host
before it creates anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spotguard.contracts import Mode, check_job_name
from spotguard.errors import ImageError, JobError

#: the one file of a container image: the runtime's checkpoint archive (uncompressed tar;
#: the image's chunks are zstd frames)
ARCHIVE_NAME = "podman-checkpoint.tar"
#: ``manifest.meta["kind"]`` of a container image (process images have none)
KIND = "container"
SCHEMA = 1

#: job-name prefixes that address a container; only podman is built (docs/limits.md)
RUNTIMES = ("podman", "docker", "containerd")
SUPPORTED = ("podman",)

#: podman's own rule for container names
_NAME_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}$")


def is_container_job(text: str) -> bool:
    """True if ``text`` names a container (``podman:NAME``, ``docker:…``, ``containerd:…``)."""
    head, sep, _ = text.partition(":")
    return bool(sep) and head in RUNTIMES


@dataclass(frozen=True)
class ContainerRef:
    """A container job: the runtime and the container's name."""

    runtime: Literal["podman"]
    name: str

    @classmethod
    def parse(cls, text: str) -> ContainerRef:
        """``podman:NAME`` → the reference; anything else is a one-line :class:`JobError`."""
        head, sep, name = text.partition(":")
        if not sep or head not in RUNTIMES:
            raise JobError(f"{text!r} is not a container job: use podman:NAME")
        if head not in SUPPORTED:
            raise JobError(
                f"{head} containers are not supported yet (podman is): see docs/limits.md"
            )
        if not _NAME_RE.match(name):
            raise JobError(
                f"invalid container name {name!r}: podman names are 1-128 of a-z A-Z 0-9 _ . - "
                "(starting with a letter or digit)"
            )
        return cls("podman", name)

    @property
    def job(self) -> str:
        """The job's name in the store (``podman-<name>``, lowercased)."""
        try:
            return check_job_name(f"{self.runtime}-{self.name.lower()}"[:63].rstrip("._-"))
        except ValueError as exc:
            raise JobError(f"container {self} has no usable job name: {exc}") from exc

    def __str__(self) -> str:
        return f"{self.runtime}:{self.name}"


class Mount(BaseModel):
    """A mount the container was given: a bind mount (``source`` on the host) or a named
    volume (``name``). Neither is carried in the image: they are the job's data."""

    model_config = ConfigDict(extra="forbid")

    type: str
    destination: str
    source: str = ""
    name: str = ""
    rw: bool = True


class Device(BaseModel):
    """A host device passed into the container."""

    model_config = ConfigDict(extra="forbid")

    host_path: str
    container_path: str
    permissions: str = ""


class Ulimit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    soft: int
    hard: int


class ContainerConfig(BaseModel):
    """The container's config as podman reported it (``podman container inspect``)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    id: str
    image: str  # the reference it was created from (``ImageName``)
    image_id: str  # the image's config digest (podman's image ID)
    repo_digests: list[str] = Field(default_factory=list)  # name@sha256:… where known
    command: list[str] = Field(default_factory=list)
    env: list[str] = Field(default_factory=list)
    mounts: list[Mount] = Field(default_factory=list)
    devices: list[Device] = Field(default_factory=list)
    network_mode: str = ""
    memory: int = 0
    nano_cpus: int = 0
    pids_limit: int = 0
    ulimits: list[Ulimit] = Field(default_factory=list)
    annotations: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def from_inspect(cls, ctr: dict[str, Any], image: dict[str, Any] | None) -> ContainerConfig:
        """Build it from ``podman container inspect`` (and ``image inspect``) JSON."""
        cfg = ctr.get("Config") or {}
        host = ctr.get("HostConfig") or {}
        try:
            return cls(
                name=ctr["Name"],
                id=ctr["Id"],
                image=ctr.get("ImageName") or ctr["Image"],
                image_id=ctr["Image"],
                repo_digests=list((image or {}).get("RepoDigests") or []),
                command=list(cfg.get("Cmd") or []),
                env=list(cfg.get("Env") or []),
                mounts=[
                    Mount(
                        type=m.get("Type", ""),
                        destination=m["Destination"],
                        source=m.get("Source", "") if m.get("Type") == "bind" else "",
                        name=m.get("Name", "") if m.get("Type") == "volume" else "",
                        rw=bool(m.get("RW", True)),
                    )
                    for m in ctr.get("Mounts") or []
                ],
                devices=[
                    Device(
                        host_path=d["PathOnHost"],
                        container_path=d.get("PathInContainer", d["PathOnHost"]),
                        permissions=d.get("CgroupPermissions", ""),
                    )
                    for d in host.get("Devices") or []
                ],
                network_mode=str(host.get("NetworkMode") or ""),
                memory=int(host.get("Memory") or 0),
                nano_cpus=int(host.get("NanoCpus") or 0),
                pids_limit=int(host.get("PidsLimit") or 0),
                ulimits=[
                    Ulimit(name=u["Name"], soft=int(u["Soft"]), hard=int(u["Hard"]))
                    for u in host.get("Ulimits") or []
                ],
                annotations={str(k): str(v) for k, v in (cfg.get("Annotations") or {}).items()},
            )
        except (KeyError, TypeError, ValueError, ValidationError) as exc:
            raise JobError(f"podman's inspect answer is not understood: {str(exc)[:200]}") from exc


class ContainerImage(BaseModel):
    """``manifest.meta["container"]`` of a container image."""

    model_config = ConfigDict(extra="forbid")

    schema_: int = Field(default=SCHEMA, alias="schema")
    runtime: Literal["podman"] = "podman"
    runtime_version: str
    criu_version: str
    mode: Mode
    archive: str = ARCHIVE_NAME
    archive_bytes: int = Field(ge=0)
    config: ContainerConfig
    #: podman's storage paths on the checkpointing host (restore moves podman's recorded
    #: paths to the target's where they differ)
    graph_root: str = ""
    run_root: str = ""

    def to_meta(self) -> dict[str, Any]:
        """The manifest ``meta`` of the image."""
        return {"kind": KIND, "container": self.model_dump(mode="json", by_alias=True)}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], where: str) -> ContainerImage:
        """The record in a manifest's ``meta``; an image that is not a container image, or a
        malformed record, is an :class:`ImageError` naming ``where``."""
        if meta.get("kind") != KIND or not isinstance(meta.get("container"), dict):
            raise ImageError(f"{where} is not a container image (it holds a process)")
        try:
            return cls.model_validate(meta["container"])
        except ValidationError as exc:
            msg = str(exc).replace("\n", " ")[:300]
            raise ImageError(f"{where}: the container record is malformed: {msg}") from exc


def is_container_image(meta: dict[str, Any]) -> bool:
    """True if a manifest's ``meta`` describes a container image."""
    return meta.get("kind") == KIND
