"""The one notice type every source produces, and the protocol a source implements.

A *notice* is the cloud (or an operator) saying "this VM is going away or should be
vacated by ``deadline``". Each source turns its metadata endpoint into :class:`Notice`
values; the bus (:mod:`spotguard.notices.bus`) merges sources, drops duplicates by ``id`` and
honours cancellations. A source never decides what to do about a notice — the agent does.

Every source implements :class:`NoticeSource`; what only some can do is declared by the
optional capability protocols below, which the bus and the agent test with ``isinstance``:

* :class:`CloudBound`    — it watches one cloud (``cloud``): the agent reports that cloud.
* :class:`Acknowledging` — the cloud waits for an approval (Azure Scheduled Events).
* :class:`Polling`       — it records its last complete poll (``last_success``), so its
  supervisor sees a recovery before any notice arrives.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable


class Cloud(StrEnum):
    """Where a notice came from."""

    AWS = "aws"
    GCP = "gcp"
    AZURE = "azure"
    MANUAL = "manual"
    FLEET = "fleet"  # seen by the controller (EventBridge → SQS), not by the VM itself


class NoticeKind(StrEnum):
    """What the notice means for the job, independent of the cloud's wording.

    ``preempt``      spot/preemptible capacity is taken back (AWS instance-action,
                     GCP preempted, Azure Preempt) — the VM dies at ``deadline``.
    ``rebalance``    elevated risk of interruption (AWS rebalance recommendation).
    ``maintenance``  scheduled host event (AWS scheduled events, GCP maintenance-event,
                     Azure Reboot/Redeploy/Freeze/Terminate) — ``action`` says which.
    ``drain``        an operator asks to vacate the node.
    """

    PREEMPT = "preempt"
    REBALANCE = "rebalance"
    MAINTENANCE = "maintenance"
    DRAIN = "drain"


@dataclass(frozen=True)
class Notice:
    """One interruption notice.

    ``deadline`` is an absolute, timezone-aware UTC time by which the VM may be gone.
    ``action`` keeps the cloud's own word (``terminate``, ``stop``, ``hibernate``,
    ``TERMINATE_ON_HOST_MAINTENANCE``, ``Reboot`` ...). ``raw`` is the payload as received.
    """

    id: str
    cloud: Cloud
    kind: NoticeKind
    deadline: datetime
    action: str | None = None
    cancelled: bool = False
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    received_at: datetime = field(
        default_factory=lambda: datetime.now(UTC), compare=False, hash=False
    )

    def __post_init__(self) -> None:
        if self.deadline.tzinfo is None:
            raise ValueError("Notice.deadline must be timezone-aware (UTC)")

    def seconds_left(self, now: datetime | None = None) -> float:
        """Seconds until the deadline (negative when past)."""
        return (self.deadline - (now or datetime.now(UTC))).total_seconds()

    def cancel(self) -> Notice:
        """The same notice, withdrawn."""
        return replace(self, cancelled=True)

    def to_json(self) -> dict[str, Any]:
        """The public JSON shape (``notices watch --json``, agent reports)."""
        return {
            "id": self.id,
            "cloud": self.cloud.value,
            "kind": self.kind.value,
            "action": self.action,
            "deadline": self.deadline.astimezone(UTC).isoformat().replace("+00:00", "Z"),
            "cancelled": self.cancelled,
            "received_at": self.received_at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        }


def stable_id(cloud: Cloud | str, kind: NoticeKind | str, payload: Any) -> str:
    """A deterministic id for notices whose source gives none (hash of the payload)."""
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(f"{cloud}|{kind}|{blob}".encode()).hexdigest()[:16]
    return f"{cloud}-{kind}-{digest}"


@runtime_checkable
class NoticeSource(Protocol):
    """A source of notices: an async iterator that yields each notice (and each cancellation,
    as the same notice with ``cancelled=True``) once it is seen.

    A source raises :class:`~spotguard.errors.NoticeError` subclasses for failures; the bus
    retries it with backoff. ``name`` is used in logs and metrics.
    """

    name: str

    def watch(self) -> AsyncIterator[Notice]: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class CloudBound(Protocol):
    """A source that watches one cloud's metadata service (or the operator: ``manual``)."""

    cloud: Cloud


@runtime_checkable
class Acknowledging(Protocol):
    """A source whose cloud holds an event until spotguard approves it (Azure)."""

    async def acknowledge(self, notice: Notice) -> None:
        """Let the event behind ``notice`` go ahead now; NoticeError when that failed."""
        ...


@runtime_checkable
class Polling(Protocol):
    """A source that records the monotonic time of its last complete poll."""

    last_success: float | None


def cloud_of(source: NoticeSource) -> Cloud | None:
    """The cloud ``source`` watches, or None when it does not say."""
    return source.cloud if isinstance(source, CloudBound) else None
