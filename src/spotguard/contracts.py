"""Contracts between spotguard's parts that cross a machine boundary.

These shapes are shared by the agent, the controller, the providers, the Terraform modules and
the machine image; change them only together (and bump ``SCHEMA``).

* **Store layout** — where images live under a store URL (one prefix per job, so a VM's
  credentials can be limited to its job's prefix)::

      {store}/{job}/chunks/{sha[:2]}/{sha}          content-addressed chunks (dedup per job)
      {store}/{job}/images/{image_id}/manifest.json written last = the image exists

* **Tags / labels** on instances spotguard launches: ``spotguard:managed=true``,
  ``spotguard:job=<job>`` (AWS); ``spotguard-managed=true``, ``spotguard-job=<job>`` (GCP labels
  cannot hold ``:``).
* **Assignment** — what a new VM must do at boot: restore image X of job J and report to the
  controller. Delivered as user-data / startup-script that writes the JSON to
  :data:`ASSIGNMENT_PATH` and starts the agent; the agent reads that file on start.
* **Agent events** — what an agent reports to the controller (``POST /v1/events``), idempotent
  by ``event_id``: one model per :class:`EventKind` (:data:`AgentEvent`, a union told apart by
  ``kind``); errors as :class:`WireError` (code, retryable). The controller answers each with
  an :class:`EventAnswer`, and ``GET /v1/jobs/{job}/directive`` with a :class:`Directive`:
  both name the job's current :class:`Owner` and whether the asker must stand down.
"""

from __future__ import annotations

import json
import shlex
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, field_validator

from spotguard.errors import SpotguardError
from spotguard.lifecycle import JobState as JobState
from spotguard.modes import Action as Action
from spotguard.modes import Mode as Mode
from spotguard.names import VM_TOKEN_PREFIX as VM_TOKEN_PREFIX
from spotguard.names import check_job_name as check_job_name
from spotguard.names import chunk_key as chunk_key
from spotguard.names import image_prefix as image_prefix
from spotguard.names import manifest_key as manifest_key
from spotguard.names import new_image_id as new_image_id
from spotguard.names import token_scope as token_scope
from spotguard.wirebase import MAX_BYTES as MAX_BYTES
from spotguard.wirebase import MAX_COUNT as MAX_COUNT
from spotguard.wirebase import MAX_SECONDS as MAX_SECONDS
from spotguard.wirebase import Bytes as Bytes
from spotguard.wirebase import Count as Count
from spotguard.wirebase import GpuDeviceInfo as GpuDeviceInfo
from spotguard.wirebase import GpuInfo as GpuInfo
from spotguard.wirebase import Seconds as Seconds
from spotguard.wirebase import Timestamp as Timestamp
from spotguard.wirebase import Wire as Wire

# The base of every shape, the bounds of its numbers and the GPU inventory's shape live in
# :mod:`spotguard.wirebase` (the checkpoint path uses them without this module's models).

#: 2: per-kind event models (no ``detail``), typed errors, ``epoch``.
SCHEMA = 2

TAG_MANAGED = "spotguard:managed"
TAG_JOB = "spotguard:job"
LABEL_MANAGED = "spotguard-managed"
LABEL_JOB = "spotguard-job"

ASSIGNMENT_PATH = "/etc/spotguard/assignment.json"
ASSIGNMENT_ENV = "SPOTGUARD_ASSIGNMENT"


class EventKind(StrEnum):
    """What an agent reports. The controller's job state machine advances on these."""

    STARTED = "started"  # agent protects the job on this instance
    NOTICE = "notice"  # an interruption notice arrived
    FROZEN = "frozen"  # the job's state is in host memory
    DURABLE = "durable"  # the image's manifest is in the store
    CHECKPOINT_FAILED = "checkpoint_failed"
    EXITED = "exited"  # the job was stopped after a checkpoint (VM may go)
    READY_TO_RELAUNCH = "ready_to_relaunch"  # drain done: relaunch elsewhere
    RESTORING = "restoring"
    RESTORED = "restored"  # the job runs again on the new instance
    RESTORE_FAILED = "restore_failed"
    JOB_FINISHED = "job_finished"  # the job itself exited (nothing more to protect)
    PARKED = "parked"  # the job was parked to a store: its process ended, its image is kept


class InstanceInfo(Wire):
    """:class:`spotguard.facts.InstanceFacts` on the wire (every field optional)."""

    provider: str = "local"
    instance_type: str | None = None
    region: str | None = None
    zone: str | None = None
    instance_id: str | None = None
    spot: bool | None = None
    extra: dict[str, JsonValue] = Field(default_factory=dict)


class NoticeInfo(Wire):
    """:meth:`spotguard.notices.base.Notice.to_json` on the wire."""

    id: str | None = None
    cloud: str | None = None
    kind: str | None = None
    action: str | None = None
    deadline: datetime | None = None
    cancelled: bool = False
    received_at: datetime | None = None

    @classmethod
    def of(cls, data: Mapping[str, object] | None) -> NoticeInfo | None:
        """From :meth:`Notice.to_json` (None stays None)."""
        return cls.model_validate(data) if data is not None else None

    def ends_vm(self) -> bool:
        """A preempt notice (spot terminate, GCP preemption, Azure Preempt, fleet warning)."""
        return self.kind == "preempt"


class HostInfo(Wire):
    """:class:`spotguard.facts.HostFacts` on the wire."""

    kernel: str
    arch: str
    memory_total: Bytes
    criu_version: str | None = None


class StepInfo(Wire):
    """One step of a :class:`spotguard.timeline.Timeline`."""

    name: str
    start: Timestamp
    start_iso: str | None = None
    seconds: Seconds | None = None
    ok: bool = True
    detail: dict[str, JsonValue] = Field(default_factory=dict)


class WireError(Wire):
    """An error as it crosses machines: the controller decides by ``retryable`` and
    ``image_fault`` (see :mod:`spotguard.errors`), never by the class name."""

    code: str
    message: str
    retryable: bool
    image_fault: bool = False

    @classmethod
    def of(cls, exc: BaseException) -> WireError:
        """The wire form of ``exc``; an error outside the tree is an ``internal`` retryable."""
        if isinstance(exc, SpotguardError):
            return cls(
                code=exc.code,
                message=f"{type(exc).__name__}: {exc}",
                retryable=exc.retryable,
                image_fault=exc.image_fault,
            )
        return cls(code="internal", message=f"{type(exc).__name__}: {exc}", retryable=True)


class _Event(Wire):
    """Fields of every agent report. ``event_id`` makes delivery idempotent; ``epoch`` is
    the sender's ownership epoch (from its assignment or scoped token, see docs/security.md):
    the controller records and ignores reports from an epoch that no longer owns the job."""

    schema_version: Count = SCHEMA
    event_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    job: str
    at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    instance: InstanceInfo = Field(default_factory=InstanceInfo)
    epoch: Count | None = None

    @field_validator("job")
    @classmethod
    def _job(cls, v: str) -> str:
        return check_job_name(v)


class StartedEvent(_Event):
    """The agent protects the job on this instance."""

    kind: Literal[EventKind.STARTED] = EventKind.STARTED
    pid: Count | None = None
    store: str | None = None


class NoticeEvent(_Event):
    """A notice arrived for the job's VM, and what the agent's policy decided for it."""

    kind: Literal[EventKind.NOTICE] = EventKind.NOTICE
    notice: NoticeInfo
    decision: Action | None = None
    reason: str | None = None
    source: str | None = None  # "fleet" when the controller saw it outside the VM


class FrozenEvent(_Event):
    kind: Literal[EventKind.FROZEN] = EventKind.FROZEN
    notice: NoticeInfo | None = None
    mode: Mode
    notice_to_frozen_s: Seconds | None = None


class DurableEvent(_Event):
    """An image's manifest is in the store. ``mode == "resume"``: the job runs on."""

    kind: Literal[EventKind.DURABLE] = EventKind.DURABLE
    notice: NoticeInfo | None = None
    image_url: str
    image_bytes: Bytes | None = None
    mode: Mode = Mode.EXIT
    gpu: GpuInfo | None = None
    host: HostInfo | None = None
    timeline: list[StepInfo] | None = None
    stored_bytes: Bytes | None = None
    skipped_bytes: Bytes | None = None
    freeze_seconds: Seconds | None = None
    pause_seconds: Seconds | None = None


class CheckpointFailedEvent(_Event):
    """A checkpoint failed; ``kept`` when its image waits on the host for the store."""

    kind: Literal[EventKind.CHECKPOINT_FAILED] = EventKind.CHECKPOINT_FAILED
    notice: NoticeInfo | None = None
    error: WireError
    step: str | None = None
    kept: bool = False
    thawed: bool | None = None


class ExitedEvent(_Event):
    """The job was stopped after its checkpoint (the VM may go)."""

    kind: Literal[EventKind.EXITED] = EventKind.EXITED
    notice: NoticeInfo | None = None
    image_url: str | None = None


class ReadyToRelaunchEvent(_Event):
    """A drain is done: relaunch the job elsewhere."""

    kind: Literal[EventKind.READY_TO_RELAUNCH] = EventKind.READY_TO_RELAUNCH
    notice: NoticeInfo | None = None
    image_url: str | None = None


class RestoringEvent(_Event):
    kind: Literal[EventKind.RESTORING] = EventKind.RESTORING
    image_url: str
    attempt: Count | None = None


class RestoredEvent(_Event):
    """The job runs again on this (new) instance."""

    kind: Literal[EventKind.RESTORED] = EventKind.RESTORED
    image_url: str
    attempt: Count | None = None
    pid: Count | None = None
    seconds: Seconds | None = None
    gpu: GpuInfo | None = None
    timeline: list[StepInfo] | None = None


class RestoreFailedEvent(_Event):
    """Restoring ``image_url`` failed; ``error`` says whether another try may succeed."""

    kind: Literal[EventKind.RESTORE_FAILED] = EventKind.RESTORE_FAILED
    image_url: str
    attempt: Count | None = None
    error: WireError


class JobFinishedEvent(_Event):
    """The job exited by itself: nothing more to protect."""

    kind: Literal[EventKind.JOB_FINISHED] = EventKind.JOB_FINISHED


class ParkedEvent(_Event):
    """The job was parked to a store (``spotguard park --to URL``, or the agent's idle or
    priority policy): its process ended and ``image_url`` holds its state. The job is not
    finished; it waits to be unparked, here by hand or anywhere through the controller."""

    kind: Literal[EventKind.PARKED] = EventKind.PARKED
    image_url: str
    image_bytes: Bytes | None = None
    reason: str | None = None


AnyEvent = (
    StartedEvent
    | NoticeEvent
    | FrozenEvent
    | DurableEvent
    | CheckpointFailedEvent
    | ExitedEvent
    | ReadyToRelaunchEvent
    | RestoringEvent
    | RestoredEvent
    | RestoreFailedEvent
    | JobFinishedEvent
    | ParkedEvent
)
#: One report from an agent (``POST /v1/events``): the union of the per-kind models,
#: told apart by ``kind``.
AgentEvent = Annotated[AnyEvent, Field(discriminator="kind")]
EVENT_ADAPTER: TypeAdapter[AnyEvent] = TypeAdapter(AgentEvent)
#: The model of each kind.
EVENT_MODELS: dict[EventKind, type[_Event]] = {
    m.model_fields["kind"].default: m
    for m in (
        StartedEvent,
        NoticeEvent,
        FrozenEvent,
        DurableEvent,
        CheckpointFailedEvent,
        ExitedEvent,
        ReadyToRelaunchEvent,
        RestoringEvent,
        RestoredEvent,
        RestoreFailedEvent,
        JobFinishedEvent,
        ParkedEvent,
    )
}


def make_event(kind: EventKind | str, **fields: object) -> AnyEvent:
    """The event of ``kind`` with ``fields`` (validated as if received), for callers that
    choose the kind at run time (tests, tools)."""
    return EVENT_ADAPTER.validate_python({**fields, "kind": EventKind(kind)})


def parse_event(body: bytes | str) -> AnyEvent:
    """An event from its JSON (raises :class:`pydantic.ValidationError`)."""
    return EVENT_ADAPTER.validate_json(body)


class Owner(Wire):
    """Who may report for a job now: the instance and epoch the controller assigned it to.
    ``instance_id`` is None while a new instance is being chosen."""

    instance_id: str | None = None
    epoch: int = 0


class Directive(Wire):
    """What the controller wants from a job's agent now: the answer to every event
    (``POST /v1/events``) and to ``GET /v1/jobs/{job}/directive``.

    ``action`` is ``"drain"`` while a migration of the protected job waits for a fresh image.
    ``stand_down`` is true when the asking agent (its token's or report's epoch) no longer
    owns the job: the job was relaunched elsewhere; the agent must stop acting for it.
    """

    job: str
    state: JobState
    action: Literal["drain"] | None = None
    reason: str | None = None
    target: dict[str, str] | None = None
    owner: Owner = Field(default_factory=Owner)
    stand_down: bool = False


class EventAnswer(Directive):
    """The answer to ``POST /v1/events`` (a :class:`Directive` plus the job's summary)."""

    duplicate: bool = False
    stale: bool = False  # the event came from a non-owner: recorded and ignored
    instance: InstanceInfo | None = None
    pending: dict[str, JsonValue] | None = None
    image_url: str | None = None
    restarts: int = 0
    since: float = 0.0
    error: str | None = None  # why the event was refused (409 to a non-owner)


class KeySources(BaseModel):
    """Where a launched VM fetches the fleet's image keys (``spotguard fetch-keys``): key
    sources such as ``aws-secretsmanager:<arn>``, never key material."""

    model_config = ConfigDict(extra="forbid")

    signing_key: str | None = None
    verify_key: str | None = None


class Assignment(BaseModel):
    """What a freshly launched VM's agent must do: restore ``image_url`` as job ``job``."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA
    job: str
    image_url: str
    store: str
    controller_url: str | None = None
    controller_token: str | None = None  # scoped to this job and epoch (never the fleet's)
    # the controller's private-network mode: plain http off loopback, accepted explicitly
    insecure_controller: bool = False
    attempt: int = 1
    epoch: int = Field(default=0, ge=0)  # the ownership epoch this instance reports under
    instance_hint: dict[str, JsonValue] = Field(default_factory=dict)
    keys: KeySources | None = None  # where the VM fetches the image keys (not the keys)

    @field_validator("job")
    @classmethod
    def _job(cls, v: str) -> str:
        return check_job_name(v)

    def user_data(self) -> str:
        """A cloud-init shell script that writes the assignment and (re)starts the agent."""
        body = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return (
            "#!/bin/sh\n"
            "# spotguard assignment: restore a job on this instance\n"
            "set -eu\n"
            "install -d -m 0700 /etc/spotguard\n"
            f"umask 077; printf '%s\\n' {shlex.quote(body)} > {ASSIGNMENT_PATH}\n"
            "systemctl restart spotguard-agent.service\n"
        )

    @classmethod
    def from_user_data(cls, text: str) -> Assignment:
        """Parse either the JSON itself or the script made by :meth:`user_data`."""
        text = text.strip()
        if text.startswith("{"):
            return cls.model_validate_json(text)
        for line in text.splitlines():
            if line.startswith("umask 077; printf"):
                quoted = shlex.split(line.split("printf '%s\\n' ", 1)[1].rsplit(" > ", 1)[0])[0]
                return cls.model_validate_json(quoted)
        raise ValueError("user-data holds no spotguard assignment")
