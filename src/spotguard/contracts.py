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
  by ``event_id``.
"""

from __future__ import annotations

import json
import re
import shlex
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

SCHEMA = 1

TAG_MANAGED = "spotguard:managed"
TAG_JOB = "spotguard:job"
LABEL_MANAGED = "spotguard-managed"
LABEL_JOB = "spotguard-job"

ASSIGNMENT_PATH = "/etc/spotguard/assignment.json"
ASSIGNMENT_ENV = "SPOTGUARD_ASSIGNMENT"

_JOB_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


def check_job_name(name: str) -> str:
    """Job names are used in object keys, tags and file names: lowercase, digits, ``._-``."""
    if not _JOB_RE.match(name):
        raise ValueError(
            f"invalid job name {name!r}: use 1-63 of a-z 0-9 . _ - (starting with a letter/digit)"
        )
    return name


def new_image_id(now: datetime | None = None) -> str:
    """Sortable image id: UTC time plus a short random suffix."""
    t = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S%fZ")
    return f"{t}-{uuid.uuid4().hex[:6]}"


def chunk_key(job: str, digest: str) -> str:
    return f"{job}/chunks/{digest[:2]}/{digest}"


def image_prefix(job: str, image_id: str) -> str:
    return f"{job}/images/{image_id}"


def manifest_key(job: str, image_id: str) -> str:
    return f"{image_prefix(job, image_id)}/manifest.json"


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


class AgentEvent(BaseModel):
    """One report from an agent. ``event_id`` makes delivery idempotent (retries are safe)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA
    event_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    job: str
    kind: EventKind
    at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    instance: dict[str, Any] = Field(default_factory=dict)  # facts.InstanceFacts.to_json()
    notice: dict[str, Any] | None = None  # Notice.to_json()
    image_url: str | None = None
    image_bytes: int | None = None
    gpu: dict[str, Any] | None = None  # facts.GpuInventory.to_json()
    timeline: list[dict[str, Any]] | None = None
    error: str | None = None
    detail: dict[str, Any] = Field(default_factory=dict)

    @field_validator("job")
    @classmethod
    def _job(cls, v: str) -> str:
        return check_job_name(v)


class Assignment(BaseModel):
    """What a freshly launched VM's agent must do: restore ``image_url`` as job ``job``."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA
    job: str
    image_url: str
    store: str
    controller_url: str | None = None
    controller_token: str | None = None
    attempt: int = 1
    instance_hint: dict[str, Any] = Field(default_factory=dict)

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
