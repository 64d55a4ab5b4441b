"""What a container job is (``podman:NAME``, ``containerd:NAMESPACE/ID``) and what its image
records about it.

A container image holds the runtime's own checkpoint archive as one file (podman: ``podman
container checkpoint --export``: CRIU's files, the writable layer, podman's config;
containerd: an OCI layout of the task's checkpoint — CRIU's files, the writable layer's diff,
the OCI spec, the runtime options — that ``ctr images import`` and ``ctr containers restore``
take), and in the manifest's ``meta`` (authenticated with the manifest) the typed
:class:`ContainerImage`: the container's config as the runtime reported it before the
checkpoint — image reference and ID or digest, env, mounts, devices, network mode, limits —
which restore checks against the target host before it creates anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spotguard.errors import ImageError, JobError
from spotguard.modes import Mode
from spotguard.names import check_job_name
from spotguard.wirebase import GpuInfo

#: the one file of a container image: the runtime's checkpoint archive (uncompressed tar;
#: the image's chunks are zstd frames)
ARCHIVE_NAME = "podman-checkpoint.tar"
#: the same for a containerd container: an OCI image layout (uncompressed tar)
CONTAINERD_ARCHIVE = "containerd-checkpoint.tar"
#: the same for a docker container: CRIU's images, the writable layer, docker's inspect
DOCKER_ARCHIVE = "docker-checkpoint.tar"
#: ``manifest.meta["kind"]`` of a container image (process images have none)
KIND = "container"
SCHEMA = 1

#: job-name prefixes that address a container
RUNTIMES = ("podman", "docker", "containerd")
SUPPORTED = ("podman", "docker", "containerd")
Runtime = Literal["podman", "docker", "containerd"]

#: podman's own rule for container names (docker's is the same, at least 2 characters)
_NAME_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}$")
#: containerd's rule for namespaces and container IDs (``identifiers.Validate``): alphanumeric
#: runs joined by single ``.``, ``_`` or ``-``, at most 76 characters
_CTRD_RE = re.compile(r"^[A-Za-z0-9]+(?:[._-][A-Za-z0-9]+)*$")
CTRD_MAX = 76


def _containerd_part(what: str, text: str, spec: str) -> str:
    if len(text) > CTRD_MAX or not _CTRD_RE.match(text):
        raise JobError(
            f"invalid containerd {what} {text!r} in {spec!r}: 1-{CTRD_MAX} of a-z A-Z 0-9 in "
            "runs joined by one . _ or - (containerd's rule)"
        )
    return text


def is_container_job(text: str) -> bool:
    """True if ``text`` names a container (``podman:NAME``, ``docker:…``, ``containerd:…``)."""
    head, sep, _ = text.partition(":")
    return bool(sep) and head in RUNTIMES


@dataclass(frozen=True)
class ContainerRef:
    """A container job: the runtime, the container's name (containerd: its ID) and, for
    containerd, its namespace."""

    runtime: Runtime
    name: str
    namespace: str = ""

    @classmethod
    def parse(cls, text: str) -> ContainerRef:
        """``podman:NAME``, ``docker:NAME`` or ``containerd:NAMESPACE/ID`` → the reference;
        anything else is a one-line :class:`JobError`."""
        head, sep, name = text.partition(":")
        if not sep or head not in RUNTIMES:
            raise JobError(
                f"{text!r} is not a container job: use podman:NAME, docker:NAME or "
                "containerd:NAMESPACE/ID"
            )
        if head == "containerd":
            ns, slash, cid = name.partition("/")
            if not slash:
                raise JobError(f"{text!r}: a containerd container is containerd:NAMESPACE/ID")
            return cls(
                "containerd",
                _containerd_part("container ID", cid, text),
                _containerd_part("namespace", ns, text),
            )
        if not _NAME_RE.match(name) or (head == "docker" and len(name) < 2):
            raise JobError(
                f"invalid container name {name!r}: {head} names are "
                f"{'2' if head == 'docker' else '1'}-128 of a-z A-Z 0-9 _ . - "
                "(starting with a letter or digit)"
            )
        return cls("docker" if head == "docker" else "podman", name)

    @property
    def job(self) -> str:
        """The job's name in the store (``podman-<name>``, ``containerd-<ns>-<id>``,
        lowercased, at most 63 characters)."""
        parts = [self.runtime, *([self.namespace] if self.namespace else []), self.name]
        try:
            return check_job_name("-".join(parts).lower()[:63].rstrip("._-"))
        except ValueError as exc:
            raise JobError(f"container {self} has no usable job name: {exc}") from exc

    def __str__(self) -> str:
        if self.runtime == "containerd":
            return f"containerd:{self.namespace}/{self.name}"
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
    runtime: Runtime = "podman"
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
    #: containerd: the container's namespace, runtime (``io.containerd.runc.v2``) and
    #: snapshotter; the image ``config.image_id`` names is its manifest digest
    namespace: str = ""
    oci_runtime: str = ""
    snapshotter: str = ""
    #: the checkpointing host's GPUs when the container held GPU state (restore maps them
    #: onto the target's, as for a process job); absent: no GPU, or an image from before
    gpu: GpuInfo | None = None

    @property
    def ref(self) -> ContainerRef:
        """The checkpointed container."""
        return ContainerRef(self.runtime, self.config.name, self.namespace)

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
