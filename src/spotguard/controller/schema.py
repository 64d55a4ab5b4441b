"""The controller state file's SQLite schema (:mod:`spotguard.controller.state`), kept apart
from the code that reads and writes it: the tables and indexes, created if absent at open.
Columns added later are also added to older files in place by the opener (e.g.
:func:`spotguard.controller.retention.upgrade_events` for ``events.size``)."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    store TEXT,
    image_url TEXT,
    spec TEXT NOT NULL DEFAULT '{}',
    instance TEXT NOT NULL DEFAULT '{}',
    pending TEXT,
    launch_token TEXT,
    launch_attempt INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0,
    deadline REAL,
    data TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    since REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL,
    at REAL NOT NULL,
    from_state TEXT,
    to_state TEXT NOT NULL,
    reason TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS history_job ON history(job, id);
CREATE TABLE IF NOT EXISTS events (
    event_id TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    kind TEXT NOT NULL,
    received REAL NOT NULL,
    body TEXT NOT NULL,
    size INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS events_job ON events(job, size);
CREATE INDEX IF NOT EXISTS events_received ON events(received);
CREATE TABLE IF NOT EXISTS images (
    job TEXT NOT NULL,
    image_url TEXT NOT NULL,
    at REAL NOT NULL,
    bytes INTEGER,
    PRIMARY KEY (job, image_url)
);
"""
