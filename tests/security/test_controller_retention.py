"""One VM's token against the controller's database over time (issue 27, item 7): the API's
rate limit bounds how fast a token grows the ``events`` table; the retention rule
(:mod:`spotguard.controller.retention`) bounds how large it gets. The controller's real
store (SQLite file, its owning thread), its clock moved forward to simulate months.

Before: every accepted event was kept whole for ever — a token sending at the limit grew the
file by about 2 MiB a minute, 86 GiB in a month."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from spotguard import config
from spotguard.contracts import EventKind, make_event
from spotguard.controller import api as controller_api
from spotguard.controller.settings import ControllerSettings
from spotguard.controller.state import StateDB
from spotguard.errors import ConfigError

VM = {"provider": "local", "instance_id": "vm-1", "region": "local", "zone": "local-1"}
BIG = 64_000  # bytes of one large event (under MAX_EVENT_BYTES)
START = 1_800_000_000.0
# the defaults a deployed controller runs with ([controller] events_keep*)
KEEP, KEEP_BYTES, KEEP_DAYS = 1000, 4 << 20, 30.0


def _event(job: str, eid: str, pad: int) -> str:
    ev = make_event(
        EventKind.STARTED, event_id=eid, job=job, instance=VM, store="file:///s" + "x" * pad
    )
    return ev.model_dump_json()


def _window() -> list[int]:
    """Paddings of one window's events at the API's limit: as many large ones as its byte
    budget takes, then small ones up to its event count."""
    small = 300
    n_big = (controller_api.EVENT_BYTES_PER_WINDOW - 120 * small) // (BIG + 200)
    return [BIG] * n_big + [0] * (controller_api.EVENTS_PER_WINDOW - n_big)


def _table(path: Path) -> tuple[int, int]:
    """(rows, bytes of bodies) of the events table, read by a separate connection."""
    conn = sqlite3.connect(path)
    try:
        rows, body = conn.execute(
            "SELECT count(*), coalesce(sum(length(CAST(body AS BLOB))), 0) FROM events"
        ).fetchone()
        return int(rows), int(body)
    finally:
        conn.close()


def _file_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


async def _send(db: StateDB, job: str, windows: int, clock: list[float], tag: str) -> list[str]:
    """``windows`` windows of events at the rate limit, one window per simulated minute."""
    ids: list[str] = []
    pads = _window()
    for w in range(windows):
        for i, pad in enumerate(pads):
            clock[0] += controller_api.EVENT_WINDOW_S / len(pads)
            eid = f"{tag}-{w}-{i}"
            ids.append(eid)
            await db.change(job, lambda r: None, event=(eid, "started", _event(job, eid, pad)))
    return ids


async def test_a_token_at_the_rate_limit_for_months_leaves_the_events_table_bounded(
    tmp_path: Path,
) -> None:
    path = tmp_path / "controller.db"
    db = await StateDB.open(path)
    clock = [START]
    db.clock = lambda: clock[0]
    try:
        # 12 minutes at the limit: ~1,440 events, ~24 MB of bodies
        await _send(db, "j1", 12, clock, "a")
        rows, body = _table(path)
        assert rows <= KEEP, f"{rows} event rows kept (limit {KEEP})"
        assert body <= KEEP_BYTES, f"{body} bytes of bodies kept"
        size_first = _file_bytes(path)
        # ten days later, as much again: the file reuses its pages, it does not grow
        clock[0] += 10 * 86400
        ids = await _send(db, "j1", 12, clock, "b")
        rows, body = _table(path)
        assert rows <= KEEP and body <= KEEP_BYTES, (rows, body)
        assert _file_bytes(path) <= size_first * 1.25 + (1 << 20), (size_first, _file_bytes(path))
        # a retried recent report is still a no-op, even one whose body was dropped
        for eid in (ids[-1], ids[-KEEP + 5]):
            _, applied = await db.change("j1", lambda r: None, event=(eid, "started", "{}"))
            assert applied is False, eid
        # another job's reports are not pushed out by j1's
        await db.change("j2", lambda r: None, event=("j2-0", "started", _event("j2", "j2-0", 0)))
        await _send(db, "j1", 2, clock, "c")
        _, applied = await db.change("j2", lambda r: None, event=("j2-0", "started", "{}"))
        assert applied is False
        # past events_keep_days, a quiet job's events are gone too
        clock[0] += (KEEP_DAYS + 1) * 86400
        await db.change("j3", lambda r: None, event=("j3-0", "started", _event("j3", "j3-0", 0)))
        assert _table(path)[0] == 1
    finally:
        await db.close()


async def test_a_state_file_of_an_earlier_build_is_bounded_when_opened(tmp_path: Path) -> None:
    """A file written before the rule (no ``size`` column, every event kept) is upgraded in
    place and pruned at open; the jobs in it are untouched."""
    path = tmp_path / "controller.db"
    db = await StateDB.open(path)
    await db.close()
    conn = sqlite3.connect(path)
    conn.executescript(
        "DROP TABLE events; CREATE TABLE events (event_id TEXT PRIMARY KEY, job TEXT NOT NULL, "
        "kind TEXT NOT NULL, received REAL NOT NULL, body TEXT NOT NULL);"
    )
    now = time.time()
    conn.executemany(
        "INSERT INTO events VALUES (?,?,?,?,?)",
        [(f"e{i}", "j1", "started", now - 60 + i / 100, "y" * 20_000) for i in range(3000)],
    )
    conn.commit()
    conn.close()
    assert _table(path) == (3000, 60_000_000)
    db = await StateDB.open(path)
    try:
        rows, body = _table(path)
        assert rows == 1000 and body <= 4 << 20, (rows, body)
        _, applied = await db.change("j1", lambda r: None, event=("e2999", "started", "{}"))
        assert applied is False  # the newest ids survived the upgrade
    finally:
        await db.close()


def test_retention_settings_have_defaults_and_refuse_a_useless_rule() -> None:
    s = ControllerSettings(events_keep=50, events_keep_bytes=1 << 20, events_keep_days=2)
    rule = s.event_retention()
    assert (rule.keep, rule.keep_bytes, rule.keep_days) == (50, 1 << 20, 2.0)
    d = ControllerSettings().event_retention()
    assert (d.keep, d.keep_bytes, d.keep_days) == (KEEP, KEEP_BYTES, KEEP_DAYS)
    # fewer than 10 ids would forget a retried report; a rule of 0 days would keep nothing
    for bad in ({"events_keep": 5}, {"events_keep_days": 0}, {"events_keep_bytes": -1}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            config.load(ControllerSettings, bad)
