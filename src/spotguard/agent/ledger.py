"""What this agent last did to each job: ``{state_dir}/agent/jobs/<job>.json``.

The agent writes a job's record when an exit checkpoint stopped it (``exited``, with the
image) or left its image kept on this host (``pushing``), when it protects it
(``protecting``), and when it stands down for it (``stood_down``: the job is owned elsewhere,
:mod:`spotguard.agent.standdown`). A restarted agent reads it to tell "stopped by our own
exit checkpoint" from "finished by itself" (a dead pid with no exit status), to leave a job
it stood down for alone, and to see whether the job's newest image in the store is one it
reported (else the job runs elsewhere, and the agent stands down).
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from spotguard import safefs
from spotguard.checkpoint.jobs import JobInfo, exit_status
from spotguard.errors import SpotguardError
from spotguard.image import ImageReader, ImageSettings, latest_image
from spotguard.modes import Mode

from .identity import Identity
from .jobstate import LEDGER_STATES, JobState
from .metrics import AgentMetrics

log = logging.getLogger(__name__)


def _recorded(state: JobState) -> JobState:
    if state not in LEDGER_STATES:
        raise ValueError(f"the ledger never records {state.value!r}")
    return state


#: A state the ledger records (:data:`spotguard.agent.jobstate.LEDGER_STATES`).
#: ``exiting`` is an intent, journaled before an exit checkpoint may stop the job: an agent
#: killed before the outcome (``exited``/``pushing``) finds it and looks for the job's image
#: in the store (:func:`exit_unrecorded`).
RecordedState = Annotated[JobState, AfterValidator(_recorded)]


class LedgerRecord(BaseModel):
    """The agent's last word on one job (one ledger file; not the controller's
    :class:`spotguard.controller.state.JobRecord`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    job: str
    pid: int
    state: RecordedState
    image_url: str | None = None
    image_at: float | None = None  # when that image's state was in host memory
    updated: float = 0.0
    # the job's identity with ``pid`` (:mod:`spotguard.agent.identity`): start time, boot
    start: int | None = None
    boot: str | None = None


class Ledger:
    """The job records under ``folder`` (one JSON file per job, replaced atomically)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def get(self, job: str) -> LedgerRecord | None:
        path = self.folder / f"{job}.json"
        try:
            return LedgerRecord.model_validate_json(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValidationError, ValueError) as exc:
            log.warning(
                "unreadable job record ignored",
                extra={"step": "job", "file": str(path), "error": str(exc)[:200]},
            )
            return None

    def put(
        self,
        job: str,
        pid: int,
        state: JobState,
        *,
        image_url: str | None = None,
        image_at: float | None = None,
        ident: Identity | None = None,
    ) -> None:
        """Record ``state`` (keeping the last image when none is given, and the identity
        recorded for this pid when ``ident`` is None); best effort — a failure is logged
        (the job's image and the controller's record still hold)."""
        old = self.get(job)
        if image_url is None and old is not None:
            image_url, image_at = old.image_url, old.image_at
        start, boot = (ident.start, ident.boot) if ident is not None else (None, None)
        if ident is None and old is not None and old.pid == pid:
            start, boot = old.start, old.boot
        rec = LedgerRecord(
            job=job,
            pid=pid,
            state=state,
            image_url=image_url,
            image_at=image_at,
            updated=time.time(),
            start=start,
            boot=boot,
        )
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            safefs.write_atomic(self.folder / f"{job}.json", rec.model_dump_json().encode())
        except OSError as exc:
            log.error(
                "cannot write the job record", extra={"step": "job", "job": job, "error": str(exc)}
            )


def stopped_by_us(ledger: Ledger, info: JobInfo, alive: bool) -> bool:
    """A dead job (``alive``: whether the job's own process runs, by identity) with no exit
    status that this agent's exit checkpoint stopped (its record says so): not "finished by
    itself"."""
    if alive or exit_status(info) is not None:
        return False
    rec = ledger.get(info.name)
    if rec is None or rec.pid != info.pid or rec.state not in (JobState.EXITED, JobState.PUSHING):
        return False
    log.info(
        "job was stopped by this agent's exit checkpoint; nothing to protect",
        extra={"step": "protect", "job": info.name, "image": rec.image_url},
    )
    return True


async def exit_unrecorded(
    ledger: Ledger,
    info: JobInfo,
    store: str,
    instance_id: str | None,
    settings: ImageSettings,
    alive: bool,
) -> tuple[str | None, float | None] | None:
    """An exit checkpoint of this very incarnation that stopped the job without the agent
    recording it (killed the instant the job stopped): the job is dead with no exit status,
    the record for its pid says ``protecting`` or ``exiting``, and the store's newest image
    is an exit image of that pid from this instance. Returns (image URL, frozen_at); with
    an ``exiting`` intent and no such image, (None, None): stopped by us, no image — the
    controller then falls back to the newest image. None: not stopped by us. ``alive``:
    whether the job's own process runs (by identity, not by pid alone)."""
    if alive or exit_status(info) is not None:
        return None
    rec = ledger.get(info.name)
    if (
        rec is None
        or rec.pid != info.pid
        or rec.state not in (JobState.PROTECTING, JobState.EXITING)
    ):
        return None
    none: tuple[str | None, float | None] | None = (
        (None, None) if rec.state is JobState.EXITING else None
    )
    try:
        url = await latest_image(store, info.name, settings=settings)
        if url is None or url == rec.image_url:
            return none
        async with ImageReader(url, settings=settings) as reader:
            meta = reader.manifest.meta
    except SpotguardError as exc:
        log.warning(
            "cannot read the job's newest image", extra={"job": info.name, "error": str(exc)}
        )
        return none
    job, inst = meta.get("job") or {}, meta.get("instance") or {}
    other = inst.get("instance_id") if isinstance(inst, dict) else None
    mine = other is None or instance_id is None or other == instance_id
    if meta.get("mode") != Mode.EXIT or not isinstance(job, dict) or job.get("pid") != info.pid:
        return none
    if not mine:
        return none
    frozen = meta.get("frozen_at")
    if isinstance(frozen, str):
        try:
            frozen = datetime.fromisoformat(frozen).timestamp()
        except ValueError:
            frozen = None
    log.warning(
        "the job was stopped by this agent's exit checkpoint and the agent stopped before "
        "recording it; reporting its image",
        extra={"step": "recover", "job": info.name, "image": url},
    )
    return url, float(frozen) if isinstance(frozen, int | float) else None


def stood_down(ledger: Ledger, info: JobInfo) -> bool:
    """This agent stood down for the job under this very pid (it is owned elsewhere): a
    restarted agent does not take it up again (a new incarnation is protected as usual)."""
    rec = ledger.get(info.name)
    if rec is None or rec.state is not JobState.STOOD_DOWN or rec.pid != info.pid:
        return False
    log.warning(
        "this agent stood down for the job before (it is owned elsewhere); not protecting it",
        extra={"step": "protect", "job": info.name, "pid": info.pid},
    )
    return True


#: how far in the future an image's id may be before it counts as a skewed clock's
FUTURE_SLACK_S = 5.0


async def newest_image(
    store: str, job: str, image_settings: ImageSettings
) -> tuple[str, float] | None:
    """The newest complete image of ``job`` (by the store's authenticated sequence) and when
    it was taken (from its id). An id is the wall clock of the VM that wrote it: one dated
    in the future (a fast clock) counts as taken now — else periodic checkpoints would wait
    for that date and the image's age would read 0 until then — and says so in the log."""
    url = await latest_image(store, job, settings=image_settings)
    if url is None:
        return None
    image_id = url.rstrip("/").rsplit("/", 1)[-1]
    try:
        at = datetime.strptime(image_id.split("-", 1)[0], "%Y%m%dT%H%M%S%fZ")
    except ValueError:
        return None
    taken = at.replace(tzinfo=UTC).timestamp()
    now = time.time()
    if taken > now + FUTURE_SLACK_S:
        log.warning(
            "the job's newest image is dated in the future (the clock of the VM that wrote "
            "it was ahead); counting it as taken now",
            extra={"job": job, "image": url, "seconds": round(taken - now, 3)},
        )
        taken = now
    return url, taken


async def newest_known(
    store: str, job: str, image_settings: ImageSettings, metrics: AgentMetrics
) -> tuple[str, float] | None:
    """:func:`newest_image`, or None when the store cannot say now (counted and logged);
    the image's time is the job's newest durable image for the metrics."""
    try:
        newest = await newest_image(store, job, image_settings)
    except SpotguardError as exc:
        metrics.failures.labels("store").inc()
        log.warning(
            "store unavailable; cannot tell the newest image's age",
            extra={"step": "store", "job": job, "error": str(exc)},
        )
        return None
    if newest is not None:
        metrics.image_durable(job, newest[1])
    return newest


async def runs_elsewhere(
    ledger: Ledger,
    job: str,
    newest: tuple[str, float] | None,
    instance_id: str | None,
    image_settings: ImageSettings,
) -> bool:
    """Whether the job's newest image is newer than this agent's last one and was written
    by another instance: the job runs elsewhere now, and this agent stands down."""
    rec = ledger.get(job)
    if rec is None or newest is None or instance_id is None:
        return False
    url, at = newest
    if url == rec.image_url or (rec.image_at is not None and at <= rec.image_at + 1.0):
        return False
    try:
        async with ImageReader(url, settings=image_settings) as reader:
            inst = reader.manifest.meta.get("instance") or {}
    except SpotguardError:
        return False
    other = inst.get("instance_id") if isinstance(inst, dict) else None
    if other is None or other == instance_id:
        return False
    log.error(
        "the job's newest image was written by another instance after this agent's last "
        "report; the job runs there: standing down",
        extra={"step": "protect", "job": job, "image": url, "instance": other},
    )
    return True
