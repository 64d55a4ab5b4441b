"""How much of the controller's ``events`` table is kept (:class:`EventRetention`).

``events`` exists so that a retried agent report is applied once (its event id is looked up
before anything changes); its body is kept for inspection only — nothing reads it back. A VM
token may report at the API's rate limit for as long as its VM lives, so without a rule the
table (and the state file) grows without bound. The rule, per job, applied in the
transaction of every insert and to every job once when the state is opened:

* the newest ``keep`` event ids are remembered; older rows are deleted. The agent delivers its
  spooled events oldest first and retries the oldest until it gets an answer, so a retried
  report is always among a job's newest events;
* rows older than ``keep_days`` are deleted, whatever the job (a job that went quiet);
* only the newest ``keep_bytes`` of bodies are kept: an older event keeps its row (and so its
  id, for deduplication) with an empty body.

So one job's rows are at most ``keep`` (about 150 bytes each without a body) plus
``keep_bytes`` of bodies; SQLite reuses the freed pages, so the file stops growing.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass


@dataclass(frozen=True)
class EventRetention:
    """The rule (``[controller] events_keep``, ``events_keep_bytes``, ``events_keep_days``)."""

    keep: int = 1000  # newest event ids remembered per job (deduplication of retries)
    keep_bytes: int = 4 << 20  # bytes of bodies kept per job, newest first
    keep_days: float = 30.0  # rows older than this are deleted, whatever the job


# A file made by an earlier build has neither (it is still schema 1: an older controller
# reads it, its inserts leave size at 0). The first index covers the per-job queries below.
_INDEXES = (
    "CREATE INDEX IF NOT EXISTS events_job ON events(job, size)",
    "CREATE INDEX IF NOT EXISTS events_received ON events(received)",
)


def prune_events(c: sqlite3.Connection, job: str | None, rule: EventRetention, now: float) -> None:
    """Apply ``rule`` to ``job``'s events (every job's when ``None``), in the caller's
    transaction."""
    c.execute("DELETE FROM events WHERE received < ?", (now - rule.keep_days * 86400.0,))
    if job is not None:
        jobs = [job]
    else:
        jobs = [r[0] for r in c.execute("SELECT DISTINCT job FROM events").fetchall()]
    for name in jobs:
        c.execute(
            "DELETE FROM events WHERE job=? AND rowid <= (SELECT rowid FROM events "
            "WHERE job=? ORDER BY rowid DESC LIMIT 1 OFFSET ?)",
            (name, name, rule.keep),
        )
        # The newest bodies up to keep_bytes stay; the first one past it and every older
        # one lose their body (the row, and so the id, stays).
        c.execute(
            "UPDATE events SET body='', size=0 WHERE job=? AND size>0 AND rowid <= ("
            "SELECT rowid FROM (SELECT rowid, SUM(size) OVER (ORDER BY rowid DESC) AS total "
            "FROM events WHERE job=? AND size>0) WHERE total > ? ORDER BY rowid DESC LIMIT 1)",
            (name, name, rule.keep_bytes),
        )


def upgrade_events(conn: sqlite3.Connection, rule: EventRetention, now: float) -> None:
    """Give a file of an earlier build the ``size`` column and the indexes, then apply
    ``rule`` to every job once (one transaction; a large old table shrinks here)."""
    cols = {r[1] for r in conn.execute("PRAGMA table_info(events)")}
    conn.execute("BEGIN IMMEDIATE")
    try:
        if "size" not in cols:
            conn.execute("ALTER TABLE events ADD COLUMN size INTEGER NOT NULL DEFAULT 0")
            conn.execute("UPDATE events SET size=length(CAST(body AS BLOB))")
        for stmt in _INDEXES:
            conn.execute(stmt)
        prune_events(conn, None, rule, now)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
