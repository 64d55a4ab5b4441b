"""What the metadata emulator knows: injected notices, instance facts, faults, tokens, stats.

The HTTP handlers (one module per cloud) render this state in each cloud's shape; the control
API and :class:`~spotguard.simulator.server.MetadataSim` change it. Every change wakes GCP
long-polls and, when the Azure document changes, bumps its ``DocumentIncarnation``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web

from spotguard.notices.timefmt import rfc1123, rfc3339

CLOUDS = ("aws", "gcp", "azure")
KINDS = ("preempt", "rebalance", "maintenance")
FAULT_MODES = ("error", "garbage", "hang")

#: (cloud, kind) → (default action, allowed actions, default seconds until the event)
CATALOG: dict[tuple[str, str], tuple[str, tuple[str, ...], float]] = {
    ("aws", "preempt"): ("terminate", ("terminate", "stop", "hibernate"), 120.0),
    ("aws", "rebalance"): ("rebalance", ("rebalance",), 0.0),
    ("aws", "maintenance"): (
        "system-reboot",
        (
            "instance-reboot",
            "system-reboot",
            "system-maintenance",
            "instance-retirement",
            "instance-stop",
        ),
        600.0,
    ),
    ("gcp", "preempt"): ("PREEMPTED", ("PREEMPTED",), 30.0),
    ("gcp", "maintenance"): (
        "TERMINATE_ON_HOST_MAINTENANCE",
        ("TERMINATE_ON_HOST_MAINTENANCE", "MIGRATE_ON_HOST_MAINTENANCE"),
        60.0,
    ),
    ("azure", "preempt"): ("Preempt", ("Preempt",), 30.0),
    ("azure", "maintenance"): ("Reboot", ("Terminate", "Reboot", "Redeploy", "Freeze"), 900.0),
}


class SimInputError(ValueError):
    """A control request the emulator cannot carry out (answered 400 / 404)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class SimNotice:
    """One injected notice. ``state``: active | cancelled | completed."""

    id: str
    cloud: str
    kind: str
    action: str
    not_before: datetime
    created: datetime = field(default_factory=lambda: datetime.now(UTC))
    state: str = "active"
    started: bool = False  # Azure: acknowledged through StartRequests

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["not_before"] = rfc3339(self.not_before)
        out["created"] = rfc3339(self.created)
        out["in_seconds"] = round((self.not_before - datetime.now(UTC)).total_seconds(), 3)
        return out


@dataclass
class SimFacts:
    """Instance facts served on every cloud's metadata paths."""

    instance_id: str = "i-0123456789abcdef0"
    instance_type: str = "g5.xlarge"
    region: str | None = None  # derived from the zone when not set
    zone: str = "us-east-1a"
    spot: bool = True
    name: str = "spotguard-sim"
    project_id: str = "spotguard-sim"
    user_data: str | None = None
    attributes: dict[str, str] = field(default_factory=dict)

    @property
    def region_name(self) -> str:
        return self.region or region_of(self.zone)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["region"] = self.region_name
        return out

    def updated(self, changes: dict[str, Any]) -> SimFacts:
        unknown = set(changes) - set(SimFacts.__dataclass_fields__)
        if unknown:
            raise SimInputError(f"unknown instance fields: {sorted(unknown)}")
        for key in ("instance_id", "instance_type", "zone", "name", "project_id"):
            if key in changes and (not isinstance(changes[key], str) or not changes[key]):
                raise SimInputError(f"{key} must be a non-empty string")
        if "spot" in changes and not isinstance(changes["spot"], bool):
            raise SimInputError("spot must be true or false")
        if "attributes" in changes and not (
            isinstance(changes["attributes"], dict)
            and all(isinstance(v, str) for v in changes["attributes"].values())
        ):
            raise SimInputError("attributes must map names to strings")
        for key in ("user_data", "region"):
            if changes.get(key) is not None and not isinstance(changes[key], str):
                raise SimInputError(f"{key} must be a string or null")
        return replace(self, **changes)


def region_of(zone: str) -> str:
    """``us-east-1a`` → ``us-east-1`` (AWS); ``us-central1-a`` → ``us-central1`` (GCP)."""
    if re.fullmatch(r"[a-z]+-[a-z]+\d+-[a-z]", zone):
        return zone.rsplit("-", 1)[0]
    if re.fullmatch(r"[a-z]+(-[a-z]+)+-\d+[a-z]", zone):
        return zone[:-1]
    return zone


@dataclass
class Fault:
    """Make matching metadata requests fail: ``error`` (HTTP ``status``), ``garbage`` (200 with
    ``body``, by default bytes no cloud sends) or ``hang`` (no answer for ``hang_s``), for
    ``count`` requests and/or ``seconds`` of time (forever when both are unset)."""

    id: str
    mode: str
    cloud: str | None = None
    path: str | None = None  # substring of the request path
    status: int = 503
    count: int | None = None
    seconds: float | None = None
    hang_s: float = 30.0
    body: str | None = None
    hits: int = 0
    expires: float | None = None  # monotonic

    def live(self, now: float) -> bool:
        if self.count is not None and self.hits >= self.count:
            return False
        return self.expires is None or now < self.expires

    def matches(self, cloud: str, path: str) -> bool:
        return (self.cloud in (None, cloud)) and (self.path is None or self.path in path)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("expires")
        return out


class SimState:
    """Everything the emulator serves, and the one place it changes."""

    def __init__(
        self,
        *,
        clouds: tuple[str, ...] = CLOUDS,
        facts: SimFacts | None = None,
        max_token_ttl: int | None = None,
        imdsv1: bool = False,
    ) -> None:
        bad = set(clouds) - set(CLOUDS)
        if bad or not clouds:
            raise SimInputError(f"clouds must be some of {CLOUDS}, got {clouds}")
        self.clouds = tuple(clouds)
        self.defaults = (facts or SimFacts(), max_token_ttl, imdsv1)
        self.closing = asyncio.Event()
        self._changed = asyncio.Event()
        self.reset()

    # -- lifecycle ---------------------------------------------------------------------------

    def reset(self) -> None:
        """Back to the start: no notices, faults or tokens; facts and options as configured."""
        self.facts, self.max_token_ttl, self.imdsv1 = self.defaults
        self.notices: dict[str, SimNotice] = {}
        self.faults: list[Fault] = []
        self.tokens: dict[str, float] = {}
        self.stats: Counter[str] = Counter()
        self.peers: dict[str, set[tuple[str, int]]] = {c: set() for c in CLOUDS}
        self.acks: list[str] = []
        self.azure_incarnation = 1
        self._azure_doc = self._azure_events_key()
        self._gcp_etags: dict[str, tuple[str, str]] = {}
        self.changed()

    def changed(self) -> None:
        """Record a change: bump the Azure incarnation if its document changed, wake waiters."""
        key = self._azure_events_key()
        if key != self._azure_doc:
            self._azure_doc = key
            self.azure_incarnation += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def wait_changed(self, within: float) -> None:
        """Return after the next change, after ``within`` seconds, or when closing."""
        event = self._changed
        waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(self.closing.wait())]
        try:
            await asyncio.wait(waiters, timeout=within, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    # -- notices -----------------------------------------------------------------------------

    def send(
        self,
        cloud: str,
        kind: str,
        action: str | None = None,
        in_seconds: float | None = None,
        notice_id: str | None = None,
    ) -> SimNotice:
        """Inject a notice (see :data:`CATALOG` for what each cloud supports)."""
        if cloud not in self.clouds:
            raise SimInputError(f"cloud must be one of {self.clouds}, got {cloud!r}")
        entry = CATALOG.get((cloud, kind))
        if entry is None:
            kinds = sorted(k for c, k in CATALOG if c == cloud)
            raise SimInputError(f"{cloud} has no {kind!r} notices (it has {kinds})")
        default_action, allowed, default_in = entry
        action = action or default_action
        if action not in allowed:
            raise SimInputError(f"{cloud} {kind} action must be one of {allowed}, got {action!r}")
        seconds = default_in if in_seconds is None else _seconds(in_seconds)
        if notice_id is not None and (not isinstance(notice_id, str) or notice_id in self.notices):
            raise SimInputError(f"notice id {notice_id!r} is not a new string id")
        now = datetime.now(UTC)
        notice = SimNotice(
            id=notice_id or _new_id(cloud, kind),
            cloud=cloud,
            kind=kind,
            action=action,
            not_before=now + timedelta(seconds=seconds),
            created=now,
        )
        self.notices[notice.id] = notice
        self.changed()
        return notice

    def get(self, notice_id: str) -> SimNotice:
        try:
            return self.notices[notice_id]
        except KeyError:
            raise SimInputError(f"no notice {notice_id!r}", status=404) from None

    def update(
        self,
        notice_id: str,
        *,
        action: str | None = None,
        in_seconds: float | None = None,
        state: str | None = None,
    ) -> SimNotice:
        """Change a notice's action, time or state (active | cancelled | completed)."""
        notice = self.get(notice_id)
        if action is not None:
            allowed = CATALOG[(notice.cloud, notice.kind)][1]
            if action not in allowed:
                raise SimInputError(f"action must be one of {allowed}, got {action!r}")
            notice.action = action
        if in_seconds is not None:
            notice.not_before = datetime.now(UTC) + timedelta(seconds=_seconds(in_seconds))
        if state is not None:
            if state not in ("active", "cancelled", "completed"):
                raise SimInputError(f"state must be active, cancelled or completed, not {state!r}")
            notice.state = state
        self.changed()
        return notice

    def cancel(self, notice_id: str) -> SimNotice:
        """Withdraw a notice (AWS scheduled events then show State ``canceled``)."""
        return self.update(notice_id, state="cancelled")

    def active(self, cloud: str, kind: str) -> list[SimNotice]:
        """Active notices of one cloud and kind, oldest first."""
        return [
            n
            for n in self.notices.values()
            if n.cloud == cloud and n.kind == kind and n.state == "active"
        ]

    def azure_events(self) -> list[SimNotice]:
        return [n for n in self.notices.values() if n.cloud == "azure" and n.state == "active"]

    def acknowledge(self, event_ids: list[str]) -> None:
        """Azure StartRequests: the events start now."""
        known = {n.id: n for n in self.azure_events()}
        missing = [e for e in event_ids if e not in known]
        if missing:
            raise SimInputError(f"unknown EventId(s): {missing}")
        for event_id in event_ids:
            known[event_id].started = True
            self.acks.append(event_id)
        self.changed()

    def _azure_events_key(self) -> str:
        if not hasattr(self, "notices"):
            return ""
        return json.dumps(
            [(n.id, n.action, rfc1123(n.not_before), n.started) for n in self.azure_events()]
        )

    # -- GCP values and ETags ----------------------------------------------------------------

    def gcp_etag(self, path: str, value: str) -> str:
        """An ETag that changes whenever the value at ``path`` changes (also back and forth)."""
        held = self._gcp_etags.get(path)
        if held is None or held[0] != value:
            salt = secrets.token_hex(4) if held is not None else ""
            etag = hashlib.sha256(f"{path}|{value}|{salt}".encode()).hexdigest()[:16]
            self._gcp_etags[path] = (value, etag)
            return etag
        return held[1]

    # -- AWS tokens --------------------------------------------------------------------------

    def new_token(self, ttl: int) -> tuple[str, int]:
        """A new IMDSv2 token and its lifetime (capped by ``max_token_ttl``)."""
        if self.max_token_ttl is not None:
            ttl = min(ttl, self.max_token_ttl)
        token = secrets.token_urlsafe(32)
        self.tokens[token] = time.monotonic() + ttl
        self.stats["aws.token_puts"] += 1
        return token, ttl

    def token_valid(self, token: str | None) -> bool:
        if token is None:
            return False
        expires = self.tokens.get(token)
        if expires is None:
            return False
        if time.monotonic() >= expires:
            del self.tokens[token]
            return False
        return True

    # -- faults ------------------------------------------------------------------------------

    def add_fault(
        self,
        mode: str,
        *,
        cloud: str | None = None,
        path: str | None = None,
        status: int = 503,
        count: int | None = None,
        seconds: float | None = None,
        hang_s: float = 30.0,
        body: str | None = None,
    ) -> Fault:
        if mode not in FAULT_MODES:
            raise SimInputError(f"fault mode must be one of {FAULT_MODES}, got {mode!r}")
        if cloud is not None and cloud not in CLOUDS:
            raise SimInputError(f"fault cloud must be one of {CLOUDS} or null")
        if not (isinstance(status, int) and 400 <= status <= 599):
            raise SimInputError("fault status must be an HTTP error code (400-599)")
        if body is not None and not isinstance(body, str):
            raise SimInputError("fault body must be a string")
        if path is not None and not isinstance(path, str):
            raise SimInputError("fault path must be a string (a part of the request path)")
        if count is not None and (not isinstance(count, int) or count < 1):
            raise SimInputError("fault count must be a positive integer")
        fault = Fault(
            id=f"fault-{uuid.uuid4().hex[:8]}",
            mode=mode,
            cloud=cloud,
            path=path,
            status=status,
            count=count,
            seconds=None if seconds is None else _seconds(seconds),
            hang_s=_seconds(hang_s),
            body=body,
        )
        if fault.seconds is not None:
            fault.expires = time.monotonic() + fault.seconds
        self.faults.append(fault)
        return fault

    def take_fault(self, cloud: str, path: str) -> Fault | None:
        """The first live fault for this request (counted as hit), or None."""
        now = time.monotonic()
        self.faults = [f for f in self.faults if f.live(now)]
        for fault in self.faults:
            if fault.matches(cloud, path):
                fault.hits += 1
                self.stats["faults"] += 1
                return fault
        return None


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise SimInputError(f"seconds must be a number >= 0, got {value!r}")
    return float(value)


def _new_id(cloud: str, kind: str) -> str:
    if cloud == "aws" and kind == "maintenance":
        return f"instance-event-{secrets.token_hex(9)[:17]}"
    if cloud == "azure":
        return str(uuid.uuid4()).upper()
    return f"sim-{cloud}-{kind}-{secrets.token_hex(4)}"


#: where the emulator's aiohttp application keeps its state
STATE = web.AppKey("state", SimState)
