"""The controller: agent events in, one reconcile loop per job, provider verbs out.

Events change a job's state at once (:mod:`spotguard.controller.machine`, fenced by ownership
epoch); each job's loop then does what takes time (:mod:`spotguard.controller.reconcile`).
This module holds the inputs — agent events, fleet notices, migrations, directive polls — and
the lifecycle. The :class:`Controller` holds a :class:`~spotguard.controller.reconcile.
Reconciler` (which holds the :class:`~spotguard.controller.images.ImageChoice`) and talks to
it through ``ensure``, ``wake``, ``hear``, ``update_gauges``, ``start`` and ``stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from spotguard.contracts import (
    AnyEvent,
    Directive,
    NoticeEvent,
    NoticeInfo,
    Owner,
)
from spotguard.controller.edge import instance_info
from spotguard.controller.machine import Options, on_event
from spotguard.controller.metrics import Metrics
from spotguard.controller.ownership import new_epoch, relaunch
from spotguard.controller.reconcile import Reconciler, report_crash
from spotguard.controller.rendezvous import Rendezvous
from spotguard.controller.settings import ControllerSettings
from spotguard.controller.state import TERMINAL, Change, JobRecord, JobState, StateDB
from spotguard.controller.strategies import Strategy, get_strategy
from spotguard.controller.tokens import Caller, TokenKeys
from spotguard.errors import (
    AuthError,
    ControllerError,
    JobNotFound,
    NoMatchingOffer,
    NoticeError,
    PrecheckError,
    SpotguardError,
)
from spotguard.image.settings import ImageSettings
from spotguard.notices.backoff import Backoff
from spotguard.notices.base import Notice, NoticeSource
from spotguard.notices.supervisor import SourceSupervisor
from spotguard.providers.base import CloudProvider, LaunchSpec

log = logging.getLogger(__name__)

_REGION_RE = re.compile(r"^[a-z]{2,}(-[a-z]+)+-?\d+$")
ADMIN = Caller(admin=True)


@dataclass(frozen=True)
class Applied:
    """What applying one event did: the record after it, whether it changed anything
    (false for a repeated event id or a duplicate notice), and why it was ignored as coming
    from a non-owner (``stale``)."""

    record: JobRecord
    applied: bool
    stale: str | None = None


class Controller:
    """Owns the state DB, the provider, the strategy, the notice sources and the
    :class:`~spotguard.controller.reconcile.Reconciler` that runs one loop per live job.

    ``image`` settings are those of the controller host (reading manifests and listing
    images); ``keys`` verify callers and issue VM tokens (default: from ``settings``).
    """

    def __init__(
        self,
        settings: ControllerSettings,
        db: StateDB,
        provider: CloudProvider,
        *,
        image: ImageSettings,
        keys: TokenKeys | None = None,
        strategy: Strategy | None = None,
        sources: Iterable[NoticeSource] = (),
    ) -> None:
        self.settings = settings
        self.db = db
        self.provider = provider
        self.image_settings = image
        self.keys = keys or settings.token_keys()
        self.strategy = strategy or get_strategy(settings.strategy)
        self.metrics = Metrics()
        self.rendezvous = Rendezvous()  # NCCL groups' freezes and rounds (in memory)
        self.reconciler = Reconciler(
            settings,
            db,
            provider,
            strategy=self.strategy,
            metrics=self.metrics,
            image_settings=image,
            keys=self.keys,
            public_url=settings.public_url(),
        )
        self._sources: list[NoticeSource] = list(sources)
        self._source_tasks: list[asyncio.Task[None]] = []

    @property
    def public_url(self) -> str:
        """What new instances report to (the server sets the bound port when on :0)."""
        return self.reconciler.public_url

    @public_url.setter
    def public_url(self, url: str) -> None:
        self.reconciler.public_url = url

    # ----- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Resume every job that is not finished or failed, and start the notice sources."""
        self.reconciler.start()
        for rec in await self.db.jobs():
            if rec.state not in TERMINAL or rec.data.terminate:
                log.info("resuming job", extra={"job": rec.name, "state": rec.state.value})
                self.reconciler.ensure(rec.name)
        for src in self._sources:
            self._start_source(src)
        await self.reconciler.update_gauges()

    async def stop(self) -> None:
        tasks = list(self._source_tasks)
        for t in tasks:
            t.cancel()
        await self.reconciler.stop()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for src in self._sources:
            with contextlib.suppress(NoticeError):
                await src.aclose()
        self._source_tasks.clear()

    def add_source(self, source: NoticeSource) -> None:
        """Treat ``source``'s notices (e.g. fleet-wide SQS) like agent NOTICE reports."""
        self._sources.append(source)
        if self.reconciler.running:
            self._start_source(source)

    def _start_source(self, source: NoticeSource) -> None:
        task = asyncio.create_task(self._watch(source), name=f"source:{source.name}")
        task.add_done_callback(report_crash)
        self._source_tasks.append(task)

    async def _watch(self, source: NoticeSource) -> None:
        """Apply every notice of ``source``; a failing source (queue unreachable, throttled,
        access denied, or a bug) is restarted by the supervisor the agent's bus uses too."""
        await SourceSupervisor(source, self._apply_notice, backoff=Backoff(1.0, 60.0)).run()

    async def _apply_notice(self, notice: Notice) -> None:
        try:
            await self.handle_notice(notice)
        except SpotguardError as exc:
            log.warning("fleet notice not applied", extra={"notice": notice.id, "error": str(exc)})

    def _wake(self, name: str) -> None:
        """Job ``name`` changed: its loop (started if need be) takes its next step now."""
        if self.reconciler.running:
            self.reconciler.ensure(name)
            self.reconciler.wake(name)

    # ----- inputs -------------------------------------------------------------------------

    async def handle_event(
        self, ev: AnyEvent, caller: Caller = ADMIN, *, ignored: Sequence[str] = ()
    ) -> Applied:
        """Apply an agent event (idempotent by ``event_id``) from ``caller``.

        A VM token may only report for its own job (:class:`AuthError`), and its events carry
        its epoch (a different one in the body is refused). An event from a non-owner is
        recorded and changes nothing (``Applied.stale``). ``ignored`` names fields of the
        report that the edge dropped (unknown to this controller): recorded in the history."""
        if not caller.may_act_for(ev.job):
            raise AuthError(f"this token may not report for job {ev.job!r}")
        if not caller.admin:
            if ev.epoch is not None and ev.epoch != caller.epoch:
                raise AuthError(f"the event says epoch {ev.epoch}; the token is for {caller.epoch}")
            ev = ev.model_copy(update={"epoch": caller.epoch})
        s = self.settings
        opts = Options(s.default_store, s.default_notice_s, s.terminate_old, s.terminate_finished)
        made: list[Change] = []

        def fn(rec: JobRecord | None) -> Change | None:
            out = on_event(rec, ev, opts)
            if out is not None and ignored:
                out.detail["ignored"] = list(ignored)
                out.note = True
            made[:] = [out] if out is not None else []
            return out

        body = ev.model_dump_json()
        rec, applied = await self.db.change(ev.job, fn, event=(ev.event_id, ev.kind.value, body))
        if rec is None:  # an event that created nothing (cannot happen for valid events)
            raise JobNotFound(f"no job {ev.job!r}")
        stale = made[0].stale if applied is False and made else None
        stale = stale or (made[0].stale if made else None)
        if stale is None:
            self._hear(rec, ev.instance.instance_id)
        extra = {"job": ev.job, "kind": ev.kind.value, "event_id": ev.event_id}
        if stale is not None:
            self.metrics.stale.labels(ev.kind.value).inc()
            log.warning("event from a non-owner ignored", extra={**extra, "reason": stale})
        elif applied:
            self.metrics.events.labels(ev.kind.value).inc()
            log.info("event", extra={**extra, "state": rec.state.value})
        else:
            self.metrics.duplicates.labels(ev.kind.value).inc()
            log.info("duplicate event", extra=extra)
        self._wake(ev.job)
        await self.reconciler.update_gauges()
        return Applied(rec, applied and stale is None, stale)

    async def handle_notice(self, notice: Notice) -> JobRecord | None:
        """A notice seen outside the VM (fleet source): find the job by instance id."""
        iid = str(notice.raw.get("instance-id") or notice.raw.get("instance_id") or "")
        if not iid:
            log.warning("fleet notice without instance id", extra={"notice": notice.id})
            return None
        for rec in await self.db.jobs():
            if str(rec.instance.get("instance_id") or "") == iid and rec.state not in TERMINAL:
                # Notice ids hold no instance id (two instances warned in the same second
                # share one), so the event id names the job and instance too.
                eid = f"{notice.cloud.value}-{rec.name}-{iid}-{notice.id}-{int(notice.cancelled)}"
                ev = NoticeEvent(
                    event_id=eid,
                    job=rec.name,
                    instance=instance_info(rec.instance),
                    epoch=rec.data.owner.epoch,  # the owner's VM is the one warned
                    notice=NoticeInfo.model_validate(notice.to_json()),
                    source=notice.cloud.value,
                )
                return (await self.handle_event(ev)).record
        log.info("fleet notice for an instance no job runs on", extra={"instance_id": iid})
        return None

    async def _target(self, rec: JobRecord, to: str, verb: str) -> dict[str, str]:
        """``to`` as a launch target, ``{"region"}`` or ``{"type"}``, checked against what
        restoring the job needs: an unknown type, a type with other GPUs or a region with no
        matching offer is refused (:class:`PrecheckError`, :class:`NoMatchingOffer`, …)."""
        spec = LaunchSpec.from_json(rec.spec)
        if to in self.provider.regions() or _REGION_RE.match(to):
            offers = await self.provider.offers(spec.retarget(region=to))
            if not offers:
                raise NoMatchingOffer(
                    f"no offer in {to} can restore job {rec.name!r} ({spec.describe_gpus()})"
                )
            return {"region": to}
        t = await self.provider.instance_type(to)
        why = spec.mismatch(t) if spec.gpu_count or t.gpu_count else None
        if why:
            raise PrecheckError(f"cannot {verb} {rec.name!r} to {to}: GPU mismatch: {why}")
        return {"type": to}

    async def migrate(self, name: str, to: str, *, immediate: bool = False) -> JobRecord:
        """Move job ``name`` to region or instance type ``to`` (validated now)."""
        rec = await self.db.get(name)
        if rec is None:
            raise JobNotFound(f"no job {name!r}")
        if rec.state is JobState.FAILED and immediate:
            return await self.retry(name, to)  # a failed job moves by being retried there
        if rec.state in TERMINAL:
            raise ControllerError(f"job {name!r} is {rec.state.value}; nothing to migrate")
        target = await self._target(rec, to, "migrate")

        def fn(r: JobRecord | None) -> Change | None:
            if r is None:
                return None
            r.data.target = target
            if r.state is JobState.PROTECTED and immediate and r.image_url:
                return relaunch(
                    r,
                    f"migrate to {to} from the newest image {r.image_url}",
                    drain=True,
                    terminate_old=True,
                )
            if r.state is JobState.PROTECTED:
                r.data.action = "drain"
                msg = f"migration to {to} requested; asking the agent to drain"
                return Change(r, msg, note=True)
            return Change(r, f"migration to {to} applies to the next launch", note=True)

        out, _ = await self.db.change(name, fn)
        assert out is not None
        self._wake(name)
        return out

    async def unpark(self, name: str, to: str | None = None) -> JobRecord:
        """Bring back job ``name``, parked to a store, on a new instance: the relaunch path a
        recovery takes (a new round under a new epoch, a VM token scoped to it, an assignment
        to restore the parked image), optionally onto region or type ``to`` (checked as
        :meth:`migrate` checks it). A job that is not PARKED is refused
        (:class:`ControllerError`) and left as it is.

        The node the job was parked on is not terminated (other jobs may use its GPUs), and
        the unpark opens a fresh budget of ``max_restarts``: it is a decision, not a failure.
        """
        rec = await self.db.get(name)
        if rec is None:
            raise JobNotFound(f"no job {name!r}")
        if rec.state is not JobState.PARKED:
            raise ControllerError(
                f"job {name!r} is {rec.state.value}, not parked; only a job parked to a store "
                "can be unparked through the controller"
            )
        target = await self._target(rec, to, "unpark") if to else None

        def fn(r: JobRecord | None) -> Change | None:
            if r is None or r.state is not JobState.PARKED:
                return None
            image = r.data.parked_image or r.image_url
            if target is not None:
                r.data.target = target
            r.image_url = image
            r.restarts = 0
            r.data.failed_rounds = 0
            r.data.bad_images, r.data.older_image = [], False
            r.data.parked_image = r.data.parked_reason = None
            where = f" in {' '.join(r.data.target.values())}" if r.data.target else ""
            reason = f"unpark{where} from the parked image {image}"
            return relaunch(r, reason, drain=False, terminate_old=False)

        out, _ = await self.db.change(name, fn)
        if out is None or out.state is not JobState.LAUNCHING:
            state = out.state.value if out is not None else "gone"
            raise ControllerError(f"job {name!r} is {state}, not parked; nothing to unpark")
        log.info("unpark", extra={"job": name, "image": out.image_url, "target": target})
        self._wake(name)
        return out

    async def retry(self, name: str, to: str | None = None) -> JobRecord:
        """Relaunch FAILED job ``name`` from its newest image (``spotguard jobs retry``,
        ``migrate --now`` of a failed job): a new round under a new epoch, as a recovery,
        with a fresh restart budget, optionally onto region or type ``to``. Images known
        bad stay refused. A job that is not FAILED is refused (:class:`ControllerError`)."""
        rec = await self.db.get(name)
        if rec is None:
            raise JobNotFound(f"no job {name!r}")
        if rec.state is not JobState.FAILED:
            raise ControllerError(
                f"job {name!r} is {rec.state.value}, not failed; only a failed job can be retried"
            )
        target = await self._target(rec, to, "retry") if to else None

        def fn(r: JobRecord | None) -> Change | None:
            if r is None or r.state is not JobState.FAILED:
                return None
            if target is not None:
                r.data.target = target
            r.data.failed_rounds = 0
            r.pending = None
            why = r.reason
            where = f" in {' '.join(r.data.target.values())}" if r.data.target else ""
            reason = f"retry{where} by the operator (it had failed: {why})"
            if not r.image_url:
                r.state = JobState.INTERRUPTING  # the loop takes the store's newest image
                r.deadline = time.time()
                r.data.fallback_now = True
                r.reason = reason
                new_epoch(r)
                return Change(r, reason)
            return relaunch(r, reason, drain=False, terminate_old=False)

        out, _ = await self.db.change(name, fn)
        if out is None or out.state is JobState.FAILED:
            state = out.state.value if out is not None else "gone"
            raise ControllerError(f"job {name!r} is {state}; nothing to retry")
        log.info("retry", extra={"job": name, "image": out.image_url, "target": target})
        self._wake(name)
        return out

    async def directive(
        self, name: str, caller: Caller = ADMIN, epoch: int | None = None
    ) -> Directive:
        """What the controller wants from job ``name``'s agent now (``GET …/directive``).

        ``action`` is ``"drain"`` while a migration of the protected job waits for a fresh
        image, else ``None``; ``owner`` names the instance and epoch that own the job, and
        ``stand_down`` tells an asker of another epoch (its token's, or ``epoch`` for the
        admin) that it lost the job. The same answer rides on every event.
        """
        if not caller.may_act_for(name):
            raise AuthError(f"this token may not act for job {name!r}")
        rec = await self.db.get(name)
        if rec is None:
            raise JobNotFound(f"no job {name!r}")
        asker = caller.epoch if not caller.admin else epoch
        answer = directive_of(rec, asker)
        if not answer.stand_down:
            self._hear(rec, None)
        return answer

    def _hear(self, rec: JobRecord, instance_id: str | None) -> None:
        """Remember that the job's agent spoke just now (an event from the job's current
        instance, or a directive poll): a job heard from after its notice's deadline still
        runs, so a resumed checkpoint must not be relaunched."""
        if instance_id is None or instance_id == rec.instance.get("instance_id"):
            self.reconciler.hear(rec.name)

    async def view(self, name: str) -> dict[str, Any]:
        """A job with its history timeline, current instance and images (for the API/CLI)."""
        rec, history, images = await self.db.snapshot(name)  # one instant: never torn
        if rec is None:
            raise JobNotFound(f"no job {name!r}")
        out = rec.to_json()
        out["owner"] = rec.data.owner.model_dump()
        out["history"] = history
        out["images"] = images
        return out


def directive_of(rec: JobRecord, asker_epoch: int | None) -> Directive:
    """The :class:`Directive` for job ``rec`` as seen by an agent of ``asker_epoch``."""
    d = rec.data
    action = d.action if rec.state is JobState.PROTECTED else None
    target = d.target if action else None
    where = " ".join(target.values()) if target else ""
    reason = (f"migrate to {where}" if where else "controller request") if action else None
    owner: Owner = d.owner
    stand_down = asker_epoch is not None and asker_epoch != owner.epoch
    if stand_down:
        action = None
        reason = f"the job is owned by epoch {owner.epoch}; this agent's epoch is {asker_epoch}"
    return Directive(
        job=rec.name,
        state=rec.state,
        action=action,
        reason=reason,
        target=target,
        owner=owner,
        stand_down=stand_down,
    )
