"""Durable controller state: one SQLite file (WAL), schema-versioned, every transition recorded.

Tables: ``jobs`` (one row per job: state, reason, newest image, current and pending instance,
launch round token, restarts, ...), ``history`` (every transition with time, reason and
detail), ``events`` (agent event ids already applied, so a retried report is a no-op) and
``images`` (durable images reported per job).

``events`` is bounded per job (:mod:`spotguard.controller.retention`, applied with every
insert): old ids are forgotten and old bodies dropped, so no token grows the file for ever.

All access goes through one dedicated thread that owns the connection; a change is a pure
function applied to the job's row inside one transaction (:meth:`StateDB.change`), so a
transition, its history row and the event id that caused it are written together or not at
all. A file that is not a readable SQLite database of this schema raises
:class:`~spotguard.errors.StateError` and is left untouched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, model_validator

from spotguard.contracts import Action, NoticeInfo, Owner, RestoredEvent, RestoreFailedEvent
from spotguard.controller.retention import EventRetention, prune_events, upgrade_events
from spotguard.controller.schema import SCHEMA as _SCHEMA
from spotguard.errors import StateError, StateRefused
from spotguard.lifecycle import TERMINAL as TERMINAL
from spotguard.lifecycle import JobState as JobState

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
T = TypeVar("T")


_JSON_COLS = ("spec", "instance", "pending", "data")


Ref = dict[str, JsonValue]  # an InstanceRef.to_json() or an agent's InstanceFacts


class SeenNotice(BaseModel):
    """A notice already applied to a job (for dedup of agent and fleet reports)."""

    origin: str
    at: float


class JobData(BaseModel):
    """What a job's record holds beyond its columns (the ``data`` column, as JSON).

    Every key is declared here; a record written by an older controller with keys this one
    does not know loads without them (``ref`` is read as ``launched``).
    """

    model_config = ConfigDict(extra="ignore", validate_assignment=True)

    owner: Owner = Field(default_factory=Owner)  # who may report for the job now
    epochs: int = 0  # the highest ownership epoch issued for the job
    notice: NoticeInfo | None = None  # the notice being handled
    decision: Action | None = None  # what the agent decided for it
    notices_seen: dict[str, SeenNotice] = Field(default_factory=dict)
    fallback_now: bool = False  # the job left without an image: use the newest at once
    checkpoint_error: str | None = None
    drain: bool = False  # the current round follows a drain
    launched: Ref | None = None  # the instance the controller launched that runs the job
    terminate: list[Ref] = Field(default_factory=list)  # instances queued for termination
    skip_offers: list[str] = Field(default_factory=list)  # offers that lost an instance
    capacity_rounds: int = 0
    #: launch rounds in a row that did not restore the job (the restart budget: reset by a
    #: successful restore, an unpark or a retry; ``restarts`` counts every round for life)
    failed_rounds: int = 0
    offer: Ref | None = None  # the offer of the current launch attempt
    spec_image: str | None = None  # the image the launch spec was read from
    target: dict[str, str] | None = None  # a pending migration: {"region"} or {"type"}
    action: Literal["drain"] | None = None  # what the controller asks of the agent
    bad_images: list[str] = Field(default_factory=list)  # images that cannot be restored
    older_image: bool = False  # the next round restores the newest image not in bad_images
    parked_image: str | None = None  # PARKED: the image the job was parked to
    parked_reason: str | None = None  # PARKED: why, as the agent or the user said
    #: LAUNCHING: the launched VM's RESTORED / RESTORE_FAILED (current epoch) that arrived
    #: before the launch was recorded; applied when it is (``machine.settle_early_report``)
    early_report: RestoredEvent | RestoreFailedEvent | None = None  # (by shape: defaults, the
    # kind among them, are left out of the stored JSON)

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        if isinstance(data, dict) and "ref" in data and "launched" not in data:
            data = {**data, "launched": data["ref"]}
        return data

    def ends_vm(self) -> bool:
        """Whether the notice being handled means the VM goes away: a preempt notice, or
        any notice the agent answered by stopping the job (decision ``exit``)."""
        return (self.notice is not None and self.notice.ends_vm()) or self.decision is Action.EXIT


@dataclass
class JobRecord:
    """One job as the controller knows it (a row of ``jobs``)."""

    name: str
    state: JobState
    reason: str = ""
    store: str | None = None
    image_url: str | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    instance: dict[str, Any] = field(default_factory=dict)
    pending: dict[str, Any] | None = None
    launch_token: str | None = None
    launch_attempt: int = 0
    restarts: int = 0
    deadline: float | None = None
    data: JobData = field(default_factory=JobData)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    since: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["state"] = self.state.value
        out["data"] = self.data.model_dump(mode="json", exclude_defaults=True)
        return out

    def copy(self) -> JobRecord:
        return replace(
            self,
            spec=dict(self.spec),
            instance=dict(self.instance),
            pending=dict(self.pending) if self.pending is not None else None,
            data=self.data.model_copy(deep=True),
        )


@dataclass
class Change:
    """What a change function returns: the new record, and a history line when it says why.

    A history row is written when the state changes or ``note`` is set. ``duplicate`` marks
    an event that repeats news already applied under another event id (the same notice from
    the agent and from the fleet queue): it is recorded, and the caller is told it changed
    nothing. ``stale`` says why an event came from a non-owner (fencing): recorded, ignored.
    A change of state makes ``reason`` the job's reason (``jobs list``, webhooks).
    """

    record: JobRecord
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)
    note: bool = False
    image: tuple[str, int | None] | None = None
    duplicate: bool = False
    stale: str | None = None  # the event came from a non-owner: why (recorded, ignored)


class StateDB:
    """The controller's SQLite state, used from asyncio through one owning thread."""

    def __init__(
        self,
        path: Path,
        *,
        init: bool = False,
        retention: EventRetention | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.init = init  # an empty (0-byte) file may be initialised
        self.retention = retention if retention is not None else EventRetention()
        self.clock = clock  # wall time of rows (received, at, updated_at)
        #: called on the loop with (state before, record after) when a job changes state
        self.on_transition: Callable[[JobState | None, JobRecord], None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spotguard-state")
        self._conn: sqlite3.Connection | None = None

    @classmethod
    async def open(
        cls,
        path: str | Path,
        *,
        init: bool = False,
        retention: EventRetention | None = None,
        clock: Callable[[], float] = time.time,
    ) -> StateDB:
        """Open (or create, when there is no file) the state at ``path``. An existing file
        of 0 bytes is refused unless ``init`` (``--init-state``): a controller that lost
        its state would forget every parked or launching job without a word. ``retention``
        bounds the ``events`` table (default :class:`EventRetention`)."""
        db = cls(Path(path), init=init, retention=retention, clock=clock)
        try:
            await db._run(db._open)
        except BaseException:
            db._pool.shutdown(wait=False)
            raise
        return db

    async def close(self) -> None:
        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        await self._run(shut)
        self._pool.shutdown(wait=True)

    async def _run(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn)

    # ----- thread side ------------------------------------------------------------------

    def _empty(self) -> bool:
        """Whether the file exists with 0 bytes (and no write-ahead log holding data)."""
        try:
            if self.path.stat().st_size != 0:
                return False
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StateError(f"state file {self.path} cannot be read: {exc}") from exc
        wal = self.path.with_name(self.path.name + "-wal")
        return not (wal.exists() and wal.stat().st_size > 0)

    def _open(self) -> None:
        where = f"state file {self.path}"
        fresh = not self.path.exists()
        empty = self._empty()
        if empty and not self.init:
            raise StateRefused(
                f"{where} is empty (0 bytes): its jobs would be forgotten; it was left as is — "
                "restore it from a backup, or start with --init-state (SPOTGUARD_INIT_STATE=1) "
                "to initialise an empty state there"
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise StateError(f"{where} cannot be opened: {exc}") from exc
        try:
            conn.execute("PRAGMA busy_timeout=5000")
            check = conn.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise StateRefused(f"{where} failed SQLite's integrity check: {check}")
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            tables = {
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
            if version == 0 and tables - {"sqlite_sequence"}:
                raise StateRefused(
                    f"{where} is an SQLite database of something else (tables {sorted(tables)})"
                )
            if version > SCHEMA_VERSION:
                raise StateRefused(
                    f"{where} has schema version {version}; this spotguard reads up to "
                    f"{SCHEMA_VERSION} — upgrade spotguard"
                )
            # Only a file known to be ours (or new) is changed: WAL mode rewrites the header.
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            if version == 0:
                conn.executescript(
                    "BEGIN;" + _SCHEMA + f"PRAGMA user_version={SCHEMA_VERSION};COMMIT;"
                )
                how = "created" if fresh else "initialised (it was empty; --init-state)"
                log.warning(f"state file {how}: no jobs", extra={"path": str(self.path)})
            upgrade_events(conn, self.retention, self.clock())
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise StateRefused(
                f"{where} is not a readable spotguard state database ({exc}); it was left as is — "
                "move it aside to start with an empty state, or restore it from a backup"
            ) from exc
        except StateError:
            conn.close()
            raise
        conn.row_factory = sqlite3.Row
        self._conn = conn

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StateError(f"state file {self.path} is closed")
        return self._conn

    def _row(self, name: str) -> JobRecord | None:
        row = self.conn.execute("SELECT * FROM jobs WHERE name=?", (name,)).fetchone()
        return _record(row) if row is not None else None

    def _change(
        self,
        name: str,
        fn: Callable[[JobRecord | None], Change | None],
        event: tuple[str, str, str] | None,
    ) -> tuple[JobRecord | None, bool]:
        """Apply ``fn`` in one transaction. Returns (record after, whether it changed; false
        for a seen event id and for a change marked ``duplicate``).

        ``event`` = (event_id, kind, body): a seen id makes the call a no-op.
        """
        c = self.conn
        try:
            c.execute("BEGIN IMMEDIATE")
            if event is not None:
                seen = c.execute("SELECT 1 FROM events WHERE event_id=?", (event[0],)).fetchone()
                if seen is not None:
                    c.execute("ROLLBACK")
                    return self._row(name), False
            before = self._row(name)
            change = fn(before.copy() if before is not None else None)
            now = self.clock()
            if event is not None:
                c.execute(
                    "INSERT INTO events(event_id, job, kind, received, body, size) "
                    "VALUES (?,?,?,?,?,?)",
                    (event[0], name, event[1], now, event[2], len(event[2].encode())),
                )
                prune_events(c, name, self.retention, now)
            if change is None:
                c.execute("COMMIT")
                return before, event is not None
            rec = change.record
            rec.updated_at = now
            moved = before is None or before.state != rec.state
            if moved:  # the job's reason is its current state's: never an earlier one's
                rec.since, rec.reason = now, change.reason
            _write(c, rec, insert=before is None)
            if moved or change.note:
                c.execute(
                    "INSERT INTO history(job, at, from_state, to_state, reason, detail) "
                    "VALUES (?,?,?,?,?,?)",
                    (
                        name,
                        now,
                        before.state.value if before is not None else None,
                        rec.state.value,
                        change.reason,
                        json.dumps(change.detail, default=str),
                    ),
                )
            if change.image is not None:
                c.execute(
                    "INSERT OR IGNORE INTO images(job, image_url, at, bytes) VALUES (?,?,?,?)",
                    (name, change.image[0], now, change.image[1]),
                )
            c.execute("COMMIT")
            return rec, not change.duplicate
        except sqlite3.Error as exc:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise StateError(f"state file {self.path}: write failed: {exc}") from exc
        except BaseException:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise

    # ----- async API ---------------------------------------------------------------------

    async def change(
        self,
        name: str,
        fn: Callable[[JobRecord | None], Change | None],
        *,
        event: tuple[str, str, str] | None = None,
    ) -> tuple[JobRecord | None, bool]:
        """Apply the pure function ``fn`` to job ``name``'s record atomically (see class doc)."""
        before: list[JobState | None] = []

        def seen(r: JobRecord | None) -> Change | None:
            before.append(r.state if r is not None else None)
            return fn(r)

        rec, changed = await self._run(lambda: self._change(name, seen, event))
        hook = self.on_transition
        if hook is not None and changed and rec is not None and before and before[-1] != rec.state:
            hook(before[-1], rec)
        return rec, changed

    async def get(self, name: str) -> JobRecord | None:
        return await self._run(lambda: self._row(name))

    async def jobs(self) -> list[JobRecord]:
        def q() -> list[JobRecord]:
            return [_record(r) for r in self.conn.execute("SELECT * FROM jobs ORDER BY name")]

        return await self._run(q)

    async def history(self, name: str, limit: int = 200) -> list[dict[str, Any]]:
        return await self._run(lambda: self._history(name, limit))

    async def images(self, name: str) -> list[dict[str, Any]]:
        return await self._run(lambda: self._images(name))

    async def snapshot(
        self, name: str
    ) -> tuple[JobRecord | None, list[dict[str, Any]], list[dict[str, Any]]]:
        """The job, its history and its images read at one instant (one thread call, so no
        change is applied in between): a view never shows an image in its history that its
        ``image_url`` does not have yet."""
        return await self._run(lambda: (self._row(name), self._history(name), self._images(name)))

    def _history(self, name: str, limit: int = 200) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT at, from_state, to_state, reason, detail FROM history "
            "WHERE job=? ORDER BY id DESC LIMIT ?",
            (name, limit),
        ).fetchall()
        return [
            {
                "at": r["at"],
                "from": r["from_state"],
                "to": r["to_state"],
                "reason": r["reason"],
                "detail": json.loads(r["detail"]),
            }
            for r in reversed(rows)
        ]

    def _images(self, name: str) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT image_url, at, bytes FROM images WHERE job=? ORDER BY at", (name,)
        ).fetchall()
        return [dict(r) for r in rows]


def _record(row: sqlite3.Row) -> JobRecord:
    try:
        values = {k: row[k] for k in row.keys()}  # noqa: SIM118 - sqlite3.Row is not a dict
        for k in _JSON_COLS:
            if values[k] is not None:
                values[k] = json.loads(values[k])
        values["state"] = JobState(values["state"])
        values["data"] = JobData.model_validate(values["data"] or {})
        return JobRecord(**values)
    except (ValueError, KeyError, TypeError, ValidationError) as exc:
        raise StateError(f"job row {row['name']!r} is inconsistent: {exc}") from exc


def _write(c: sqlite3.Connection, rec: JobRecord, *, insert: bool) -> None:
    values = rec.to_json()
    for k in _JSON_COLS:
        if values[k] is not None:
            values[k] = json.dumps(values[k], default=str)
    cols = list(values)
    if insert:
        c.execute(
            f"INSERT INTO jobs({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",
            [values[k] for k in cols],
        )
    else:
        sets = ",".join(f"{k}=?" for k in cols if k != "name")
        c.execute(
            f"UPDATE jobs SET {sets} WHERE name=?",
            [values[k] for k in cols if k != "name"] + [rec.name],
        )
