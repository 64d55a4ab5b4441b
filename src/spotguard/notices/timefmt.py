"""The time formats the metadata services use, parsed into timezone-aware UTC datetimes.

* RFC 3339 — AWS ``spot/instance-action`` ``time``, rebalance ``noticeTime``.
* ``21 Jan 2019 09:00:43 GMT`` — AWS scheduled events ``NotBefore``.
* RFC 1123 — Azure ``NotBefore`` (``Mon, 19 Sep 2016 18:29:47 GMT``).

A notice whose time is missing or unreadable is still a notice: :func:`due_time` reads it as
due now (and says so once in the log), so the job is protected at once instead of the notice
being dropped as malformed. A *deadline* is read by :func:`deadline_of`: missing, unreadable
or already past, it is now plus the longest budget the cloud documents for that notice (AWS
spot: 2 minutes; Azure Preempt: 30 s) — act at once, never with a zero budget that would
kill the checkpoint before it writes anything.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime, parsedate_to_datetime

from spotguard.errors import MetadataMalformed

log = logging.getLogger(__name__)

_AWS_EVENT_FORMAT = "%d %b %Y %H:%M:%S GMT"
#: (what, value) pairs already logged as unreadable (each is logged once, not every poll)
_WARNED: set[tuple[str, str]] = set()


def parse_time(value: object, what: str) -> datetime:
    """Parse any of the formats above; a value that is none of them is malformed metadata."""
    if not isinstance(value, str) or not value.strip():
        raise MetadataMalformed(f"{what}: expected a time, got {value!r}")
    text = value.strip()
    parsed: datetime | None = None
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        try:
            parsed = datetime.strptime(text, _AWS_EVENT_FORMAT).replace(tzinfo=UTC)
        except ValueError:
            try:
                parsed = parsedate_to_datetime(text)
            except (TypeError, ValueError, IndexError):
                parsed = None
    if parsed is None:
        raise MetadataMalformed(f"{what}: not a time: {value!r}")
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC)


def due_time(value: object, what: str, *, now: datetime | None = None) -> datetime:
    """The time in ``value``, or ``now`` when it is missing or not a time: a notice whose
    deadline cannot be read is acted on at once, never dropped."""
    try:
        return parse_time(value, what)
    except MetadataMalformed as exc:
        key = (what, repr(value)[:200])
        if key not in _WARNED:
            if len(_WARNED) > 1000:
                _WARNED.clear()
            _WARNED.add(key)
            log.warning("%s; treating the notice as due now", exc, extra={"step": "notice"})
        return now or datetime.now(UTC)


def deadline_of(
    value: object, what: str, budget: timedelta, *, now: datetime | None = None
) -> datetime:
    """The deadline in ``value``; when it is missing, unreadable or not in the future (a
    skewed clock, a stale answer), ``now + budget``: the notice is acted on at once with the
    cloud's documented budget, never a zero one. Logged once per value."""
    now = now or datetime.now(UTC)
    try:
        parsed = parse_time(value, what)
    except MetadataMalformed as exc:
        _warn_once(what, value, f"{exc}; acting now with {budget.total_seconds():.0f} s")
        return now + budget
    if parsed <= now:
        late = f"{what}: {value!r} is not in the future"
        _warn_once(what, value, f"{late}; acting now with {budget.total_seconds():.0f} s")
        return now + budget
    return parsed


def _warn_once(what: str, value: object, message: str) -> None:
    key = (what, repr(value)[:200])
    if key not in _WARNED:
        if len(_WARNED) > 1000:
            _WARNED.clear()
        _WARNED.add(key)
        log.warning(message, extra={"step": "notice"})


def rfc3339(t: datetime) -> str:
    """``2026-11-22T10:00:00Z`` (the AWS spot and rebalance format)."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def aws_event_time(t: datetime) -> str:
    """``22 Nov 2026 10:00:00 GMT`` (the AWS scheduled-events format)."""
    return t.astimezone(UTC).strftime(_AWS_EVENT_FORMAT)


def rfc1123(t: datetime) -> str:
    """``Sun, 22 Nov 2026 10:00:00 GMT`` (the Azure format)."""
    return format_datetime(t.astimezone(UTC), usegmt=True)
