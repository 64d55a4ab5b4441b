"""The controller: agent events in, one reconcile loop per job, provider verbs out.

Events change a job's state at once (:mod:`spotguard.controller.machine`); each job's loop
then does what takes time, one step per wake-up, persisting before every side effect:

* INTERRUPTING past deadline + grace (or the job left without an image) → the store's newest
  complete image (:func:`spotguard.image.latest_image`) → LAUNCHING, else FAILED — only for a
  notice that ends the VM (:func:`~spotguard.controller.machine.ends_vm`); any other notice
  past its deadline returns the job to PROTECTED (it was never stopped).
* CHECKPOINTED past deadline + grace → LAUNCHING (the VM is gone without saying so), unless
  the job's agent was heard from after the deadline (an event or a directive poll from the
  job's instance): then the job still runs there and is PROTECTED again.
* LAUNCHING → a round token is persisted first; with one already persisted (a restart
  mid-launch) the provider is asked for the instance tagged with it before anything is
  launched. Then the strategy's candidates are tried in order, each attempt's index persisted
  before the call: capacity errors move on, precheck errors give up.
* RESTORING → wait until the instance runs; past ``restore_timeout_s`` without the agent's
  RESTORED → terminate it and start a new round.

Old instances queued for termination are terminated by the loop, whatever the state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from spotguard.contracts import AgentEvent, Assignment, EventKind
from spotguard.controller.imagefacts import image_spec
from spotguard.controller.machine import ends_vm, on_event, relaunch
from spotguard.controller.settings import ControllerSettings
from spotguard.controller.state import TERMINAL, Change, JobRecord, JobState, StateDB
from spotguard.controller.strategies import Strategy, get_strategy
from spotguard.errors import (
    CapacityError,
    ControllerError,
    JobNotFound,
    NoMatchingOffer,
    NoticeError,
    PrecheckError,
    ProviderError,
    SpotguardError,
    UnknownInstanceType,
)
from spotguard.notices.backoff import Backoff
from spotguard.notices.base import Notice, NoticeSource
from spotguard.notices.supervisor import SourceSupervisor
from spotguard.providers.base import (
    CloudProvider,
    InstanceRef,
    InstanceState,
    LaunchSpec,
    Market,
    Offer,
)

log = logging.getLogger(__name__)

_REGION_RE = re.compile(r"^[a-z]{2,}(-[a-z]+)+-?\d+$")


class Metrics:
    """Prometheus metrics of one controller (own registry, so several can live in a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.events = Counter(
            "spotguard_controller_events", "Agent events applied", ["kind"], registry=self.registry
        )
        self.launches = Counter(
            "spotguard_controller_launches",
            "Launch attempts by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.duplicates = Counter(
            "spotguard_controller_duplicate_events",
            "Events that repeated news already applied (retried reports; a notice reported "
            "by both the agent and the fleet queue)",
            ["kind"],
            registry=self.registry,
        )
        self.jobs = Gauge(
            "spotguard_controller_jobs", "Jobs by state", ["state"], registry=self.registry
        )


def _ref_of(d: dict[str, Any], provider: str) -> InstanceRef | None:
    """An InstanceRef from a stored ref or from an agent's InstanceFacts."""
    if not d.get("instance_id") or d.get("provider", provider) != provider:
        return None
    if "market" in d and "state" in d:
        return InstanceRef.from_json(d)
    return InstanceRef(
        provider=provider,
        instance_id=str(d["instance_id"]),
        region=str(d.get("region") or ""),
        zone=str(d.get("zone") or ""),
        instance_type=str(d.get("instance_type") or ""),
        market=Market.SPOT if d.get("spot") else Market.ON_DEMAND,
    )


def _runs_on(why: str) -> Any:
    """A change back to PROTECTED: the job was not stopped by the notice."""

    def mutate(r: JobRecord) -> Change:
        r.state = JobState.PROTECTED
        r.deadline = None
        reason = f"the job still runs: {why}"
        return Change(r, reason)

    return mutate


def _report_crash(task: asyncio.Task[None]) -> None:
    """Log a job loop that died of an unexpected error (the next event restarts it)."""
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        log.error("job loop crashed", extra={"task": task.get_name(), "error": repr(exc)})


def store_of(rec: JobRecord, default: str | None) -> str | None:
    """The job's store: reported, else configured, else read off the image URL."""
    if rec.store:
        return rec.store
    if default:
        return default
    if rec.image_url and f"/{rec.name}/images/" in rec.image_url:
        return rec.image_url.rsplit(f"/{rec.name}/images/", 1)[0]
    return None


class Controller:
    """Owns the state DB, the provider, the strategy and one loop task per live job."""

    def __init__(
        self,
        settings: ControllerSettings,
        db: StateDB,
        provider: CloudProvider,
        *,
        strategy: Strategy | None = None,
        sources: Iterable[NoticeSource] = (),
    ) -> None:
        self.settings = settings
        self.db = db
        self.provider = provider
        self.strategy = strategy or get_strategy(settings.strategy)
        self.metrics = Metrics()
        self._sources: list[NoticeSource] = list(sources)
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._source_tasks: list[asyncio.Task[None]] = []
        self._checked: dict[str, float] = {}  # "<job>:<instance>" → last liveness check
        self._heard: dict[str, float] = {}  # job → when its agent last reported or polled
        self._running = False
        #: What new instances report to (the server sets the bound port when listening on :0).
        self.public_url = settings.public_url()

    # ----- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Resume every job that is not finished or failed, and start the notice sources."""
        self._running = True
        for rec in await self.db.jobs():
            if rec.state not in TERMINAL or rec.data.get("terminate"):
                log.info("resuming job", extra={"job": rec.name, "state": rec.state.value})
                self._ensure_loop(rec.name)
        for src in self._sources:
            self._start_source(src)
        await self._update_gauges()

    async def stop(self) -> None:
        self._running = False
        tasks = [*self._loops.values(), *self._source_tasks]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for src in self._sources:
            with contextlib.suppress(NoticeError):
                await src.aclose()
        self._loops.clear()
        self._source_tasks.clear()

    def add_source(self, source: NoticeSource) -> None:
        """Treat ``source``'s notices (e.g. fleet-wide SQS) like agent NOTICE reports."""
        self._sources.append(source)
        if self._running:
            self._start_source(source)

    def _start_source(self, source: NoticeSource) -> None:
        task = asyncio.create_task(self._watch(source), name=f"source:{source.name}")
        task.add_done_callback(_report_crash)
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

    def _ensure_loop(self, name: str) -> None:
        task = self._loops.get(name)
        if task is None or task.done():
            self._wake.setdefault(name, asyncio.Event())
            task = asyncio.create_task(self._loop(name), name=f"job:{name}")
            task.add_done_callback(_report_crash)
            self._loops[name] = task

    def wake(self, name: str) -> None:
        ev = self._wake.get(name)
        if ev is not None:
            ev.set()

    # ----- inputs -------------------------------------------------------------------------

    async def handle_event(self, ev: AgentEvent) -> tuple[JobRecord, bool]:
        """Apply an agent event (idempotent by ``event_id``). Returns (record, applied)."""
        s = self.settings

        def fn(rec: JobRecord | None) -> Change | None:
            return on_event(
                rec,
                ev,
                default_store=s.default_store,
                default_notice_s=s.default_notice_s,
                terminate_old=s.terminate_old,
                terminate_finished=s.terminate_finished,
            )

        body = ev.model_dump_json()
        rec, applied = await self.db.change(ev.job, fn, event=(ev.event_id, ev.kind.value, body))
        if rec is None:  # an event that created nothing (cannot happen for valid events)
            raise JobNotFound(f"no job {ev.job!r}")
        self._hear(rec, ev.instance)
        if applied:
            self.metrics.events.labels(ev.kind.value).inc()
            log.info(
                "event",
                extra={"job": ev.job, "kind": ev.kind.value, "state": rec.state.value},
            )
        else:
            self.metrics.duplicates.labels(ev.kind.value).inc()
            log.info(
                "duplicate event",
                extra={"job": ev.job, "kind": ev.kind.value, "event_id": ev.event_id},
            )
        if self._running:
            self._ensure_loop(ev.job)
            self.wake(ev.job)
        await self._update_gauges()
        return rec, applied

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
                ev = AgentEvent(
                    event_id=eid,
                    job=rec.name,
                    kind=EventKind.NOTICE,
                    instance=rec.instance,
                    notice=notice.to_json(),
                    detail={"source": notice.cloud.value},
                )
                out, _ = await self.handle_event(ev)
                return out
        log.info("fleet notice for an instance no job runs on", extra={"instance_id": iid})
        return None

    async def migrate(self, name: str, to: str, *, immediate: bool = False) -> JobRecord:
        """Move job ``name`` to region or instance type ``to`` (validated now)."""
        rec = await self.db.get(name)
        if rec is None:
            raise JobNotFound(f"no job {name!r}")
        if rec.state in TERMINAL:
            raise ControllerError(f"job {name!r} is {rec.state.value}; nothing to migrate")
        spec = LaunchSpec.from_json(rec.spec)
        if to in self.provider.regions() or _REGION_RE.match(to):
            target = {"region": to}
            offers = await self.provider.offers(spec.retarget(region=to))
            if not offers:
                raise NoMatchingOffer(
                    f"no offer in {to} can restore job {name!r} ({spec.describe_gpus()})"
                )
        else:
            t = await self.provider.instance_type(to)
            why = spec.mismatch(t) if spec.gpu_count or t.gpu_count else None
            if why:
                raise PrecheckError(f"cannot migrate {name!r} to {to}: GPU mismatch: {why}")
            target = {"type": to}

        def fn(r: JobRecord | None) -> Change | None:
            if r is None:
                return None
            r.data["target"] = target
            if r.state is JobState.PROTECTED and immediate and r.image_url:
                return relaunch(
                    r,
                    f"migrate to {to} from the newest image {r.image_url}",
                    drain=True,
                    terminate_old=True,
                )
            if r.state is JobState.PROTECTED:
                r.data["action"] = "drain"
                msg = f"migration to {to} requested; asking the agent to drain"
                return Change(r, msg, note=True)
            return Change(r, f"migration to {to} applies to the next launch", note=True)

        out, _ = await self.db.change(name, fn)
        assert out is not None
        self._ensure_loop(name)
        self.wake(name)
        return out

    async def directive(self, name: str) -> dict[str, Any]:
        """What the controller wants from job ``name``'s agent now (``GET …/directive``).

        ``{"job", "action", "reason", "state", "target"}``; ``action`` is ``"drain"`` while a
        migration of the protected job waits for a fresh image, else ``None``. The same
        ``action`` rides on every event answer; this lets an agent that has nothing to report
        learn it by polling.
        """
        rec = await self.db.get(name)
        if rec is None:
            raise JobNotFound(f"no job {name!r}")
        self._hear(rec, None)
        action = rec.data.get("action") if rec.state is JobState.PROTECTED else None
        target = rec.data.get("target") if action else None
        where = " ".join(str(v) for v in (target or {}).values())
        reason = (f"migrate to {where}" if where else "controller request") if action else None
        return {
            "job": rec.name,
            "action": action,
            "reason": reason,
            "state": rec.state.value,
            "target": target,
        }

    def _hear(self, rec: JobRecord, instance: dict[str, Any] | None) -> None:
        """Remember that the job's agent spoke just now (an event from the job's current
        instance, or a directive poll): a job heard from after its notice's deadline still
        runs, so a resumed checkpoint must not be relaunched."""
        iid = (instance or {}).get("instance_id")
        if iid is None or iid == rec.instance.get("instance_id"):
            self._heard[rec.name] = time.time()

    async def view(self, name: str) -> dict[str, Any]:
        """A job with its history timeline, current instance and images (for the API/CLI)."""
        rec = await self.db.get(name)
        if rec is None:
            raise JobNotFound(f"no job {name!r}")
        out = rec.to_json()
        out["history"] = await self.db.history(name)
        out["images"] = await self.db.images(name)
        return out

    # ----- reconcile loop -------------------------------------------------------------------

    async def _loop(self, name: str) -> None:
        wake = self._wake.setdefault(name, asyncio.Event())
        while self._running:
            wake.clear()
            rec = await self.db.get(name)
            if rec is None:
                return
            try:
                await self._terminate_queued(rec)
                if rec.state in TERMINAL:
                    return
                await self._step(rec)
            except SpotguardError as exc:
                # Typed and expected (provider down, state write failed): log, retry next tick.
                log.warning("reconcile step failed", extra={"job": name, "error": str(exc)})
            await self._update_gauges()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self.settings.tick_s)

    async def _step(self, rec: JobRecord) -> None:
        now = time.time()
        s = self.settings
        if rec.state is JobState.INTERRUPTING:
            due = (rec.deadline or now) + (0 if rec.data.get("fallback_now") else s.notice_grace_s)
            if now >= due and (rec.data.get("fallback_now") or ends_vm(rec.data.get("notice"))):
                await self._fallback(rec)
            elif now >= due:
                await self._set(rec, _runs_on("the notice's deadline passed; nothing stopped it"))
        elif rec.state is JobState.CHECKPOINTED:
            deadline = rec.deadline
            if deadline is not None and self._heard.get(rec.name, 0.0) > deadline:
                await self._set(
                    rec, _runs_on("its agent reported after the notice's deadline; it runs on")
                )
            elif deadline is not None and now >= deadline + s.notice_grace_s:
                await self._set(
                    rec,
                    lambda r: relaunch(
                        r,
                        "notice deadline passed with a durable image; relaunching",
                        drain=False,
                        terminate_old=s.terminate_old,
                    ),
                )
        elif rec.state is JobState.LAUNCHING:
            await self._launch_round(rec)
        elif rec.state is JobState.RESTORING:
            await self._restoring(rec)

    async def _set(
        self, rec: JobRecord, mutate: Any, *, expect: JobState | None = None
    ) -> JobRecord | None:
        """Persist ``mutate(record) -> Change | None`` if the job is still in ``expect``."""
        want = expect or rec.state
        token = rec.launch_token

        def fn(r: JobRecord | None) -> Change | None:
            if r is None or r.state is not want or r.launch_token != token:
                return None
            result: Change | None = mutate(r)
            return result

        out, _ = await self.db.change(rec.name, fn)
        return out

    def _fail(self, reason: str) -> Any:
        def mutate(r: JobRecord) -> Change:
            r.state = JobState.FAILED
            r.reason = reason
            log.error("job failed", extra={"job": r.name, "reason": reason})
            return Change(r, reason)

        return mutate

    async def _fallback(self, rec: JobRecord) -> None:
        store = store_of(rec, self.settings.default_store)
        url: str | None = None
        why = ""
        if store is None:
            why = "no store is known for the job"
        else:
            try:
                from spotguard.image import latest_image
            except ImportError as exc:
                why = f"cannot read the store ({exc})"
            else:
                try:
                    url = await latest_image(store, rec.name)
                except SpotguardError as exc:
                    why = f"store {store}: {exc}"
                else:
                    why = f"store {store} holds no complete image of {rec.name}"
        if url is None:
            await self._set(rec, self._fail(f"no durable image after the notice and {why}"))
            return
        chosen = url

        def mutate(r: JobRecord) -> Change:
            r.image_url = chosen
            r.data.pop("fallback_now", None)
            return relaunch(
                r,
                f"no durable image reported; relaunching from the newest image {chosen}",
                drain=False,
                terminate_old=self.settings.terminate_old,
            )

        await self._set(rec, mutate)

    async def _spec_from_image(self, rec: JobRecord) -> JobRecord:
        """Before a round: the launch spec from the image's manifest, once per image.

        The manifest's GPU facts describe what restoring that image needs, so they win over
        what reports said (or did not say: a fall-back without a DURABLE report, or a report
        without GPU facts). An unreadable manifest keeps the recorded spec and says why.
        """
        url = rec.image_url
        if not url or rec.data.get("spec_image") == url:
            return rec
        recorded = LaunchSpec.from_json(rec.spec)
        try:
            spec = await image_spec(url, recorded)
        except SpotguardError as exc:
            msg = f"cannot read the manifest of {url} ({exc}); launching for the reported facts"
            log.warning("image manifest unreadable", extra={"job": rec.name, "error": str(exc)})

            def keep(r: JobRecord) -> Change:
                r.data["spec_image"] = url
                return Change(r, msg, note=True)

            return await self._set(rec, keep) or rec

        def adopt(r: JobRecord) -> Change:
            r.data["spec_image"] = url
            if spec is None:
                msg = f"the manifest of {url} holds no GPU facts; keeping the reported spec"
                return Change(r, msg, note=True)
            r.spec = spec.to_json()
            where = spec.instance_type or "any type"
            return Change(
                r,
                f"launch spec from the image's manifest: {spec.describe_gpus()}, ran on {where} "
                f"(reports said {recorded.describe_gpus()})",
                {"spec": r.spec},
                note=True,
            )

        return await self._set(rec, adopt) or rec

    def _assignment(self, rec: JobRecord, offer_hint: dict[str, Any]) -> Assignment:
        store = store_of(rec, self.settings.default_store)
        if rec.image_url is None or store is None:
            raise PrecheckError(f"job {rec.name!r} has no image to restore")
        return Assignment(
            job=rec.name,
            image_url=rec.image_url,
            store=store,
            controller_url=self.public_url,
            controller_token=self.settings.token(),
            attempt=rec.restarts,
            instance_hint=offer_hint,
        )

    async def _launch_round(self, rec: JobRecord) -> None:
        s = self.settings
        if rec.launch_token:
            found = await self.provider.find_by_token(rec.launch_token)
            if found is not None and found.state is not InstanceState.TERMINATED:
                ref = found

                def adopt(r: JobRecord) -> Change:
                    r.state = JobState.RESTORING
                    r.pending = ref.to_json()
                    r.reason = f"found {ref.instance_id} launched in round {ref.launch_token}"
                    return Change(r, r.reason, {"instance": ref.to_json()})

                await self._set(rec, adopt)
                return
        else:
            if rec.restarts >= s.max_restarts:
                await self._set(rec, self._fail(f"max restarts ({s.max_restarts}) reached"))
                return
            rec = await self._spec_from_image(rec)
            token = uuid.uuid4().hex[:16]

            def begin(r: JobRecord) -> Change:
                r.launch_token = token
                r.launch_attempt = 0
                r.restarts += 1
                return Change(r, f"launch round {r.restarts} (token {token})", note=True)

            await self._set(rec, begin)
            got = await self.db.get(rec.name)
            if got is None or got.launch_token != token:
                return
            rec = got
        target = rec.data.get("target") or {}
        spec = LaunchSpec.from_json(rec.spec).retarget(
            region=target.get("region"), instance_type=target.get("type")
        )
        try:
            offers = await self.provider.offers(spec)
        except (PrecheckError, UnknownInstanceType) as exc:
            await self._set(rec, self._fail(str(exc)))
            return
        cands = self.strategy.candidates(
            spec,
            offers,
            on_demand_fallback=s.on_demand_fallback,
            types_per_zone=s.types_per_zone,
            limit=s.max_candidates,
        )
        skip = set(rec.data.get("skip_offers") or [])
        if skip:  # offers whose instance was lost this interruption go last-resort only
            cands = [c for c in cands if c.label() not in skip] or cands
        if not cands:
            where = target.get("region") or ", ".join(self.provider.regions())
            why = f"no offer matches {spec.describe_gpus()} anywhere in {where}"
            await self._set(rec, self._fail(str(NoMatchingOffer(why))))
            return
        round_token = rec.launch_token
        assert round_token is not None
        for i in range(rec.launch_attempt, len(cands)):
            if not await self._attempt(rec, round_token, i, cands[i], len(cands)):
                return
        # Every candidate lacked capacity.
        rounds = int(rec.data.get("capacity_rounds", 0)) + 1
        if rounds >= s.capacity_rounds:
            await self._set(
                rec,
                self._fail(f"no capacity in any of {len(cands)} offers after {rounds} passes"),
            )
            return

        def again(r: JobRecord) -> Change:
            r.data["capacity_rounds"] = rounds
            r.launch_attempt = 0
            return Change(r, f"no capacity anywhere (pass {rounds}); retrying later", note=True)

        await self._set(rec, again)
        await asyncio.sleep(s.capacity_retry_s)

    async def _attempt(self, rec: JobRecord, token: str, i: int, offer: Offer, n: int) -> bool:
        """Launch attempt ``i`` of a round; ``True`` means "try the next candidate"."""

        def attempt(r: JobRecord) -> Change:
            r.launch_attempt = i
            r.data["offer"] = offer.to_json()
            return Change(r, f"attempt {i + 1}/{n}: {offer.label()}", note=True)

        if await self._set(rec, attempt) is None:
            return False  # the job moved on meanwhile
        hint = {**offer.to_json(), "launch_token": token}
        try:
            ref = await self.provider.launch(
                offer, self._assignment(rec, hint), client_token=f"{token}-{i}"
            )
        except CapacityError as exc:
            self.metrics.launches.labels("capacity").inc()
            msg = f"no capacity: {offer.label()}: {exc}"
            await self._set(rec, lambda r: Change(r, msg, note=True))
            return True
        except (PrecheckError, UnknownInstanceType) as exc:
            self.metrics.launches.labels("precheck").inc()
            await self._set(rec, self._fail(f"launch refused: {exc}"))
            return False
        except ProviderError as exc:
            self.metrics.launches.labels("error").inc()
            msg = f"launch error (retrying): {exc}"
            await self._set(rec, lambda r: Change(r, msg, note=True))
            return False
        self.metrics.launches.labels("launched").inc()

        def up(r: JobRecord) -> Change:
            r.state = JobState.RESTORING
            r.pending = ref.to_json()
            r.data.pop("target", None)
            r.data.pop("action", None)
            r.reason = f"launched {ref.instance_id} ({offer.label()}); assignment delivered"
            return Change(r, r.reason, {"instance": ref.to_json()})

        if await self._set(rec, up) is None:
            log.warning("job moved on during launch; terminating", extra={"job": rec.name})
            await self.provider.terminate(ref)
        return False

    @staticmethod
    def _abandon(ref: InstanceRef, reason: str) -> Any:
        """A failed attempt: queue ``ref`` for termination and start a new round (counted
        against ``max_restarts``) that tries the other offers before this one's."""

        def mutate(r: JobRecord) -> Change:
            r.data.setdefault("terminate", []).append(ref.to_json())
            label = f"{ref.instance_type}@{ref.zone}/{ref.market.value}"
            skip = r.data.setdefault("skip_offers", [])
            if label not in skip:
                skip.append(label)
            r.pending = None
            r.state = JobState.LAUNCHING
            r.launch_token = None
            r.launch_attempt = 0
            r.reason = reason
            return Change(r, reason, {"instance": ref.to_json()})

        return mutate

    async def _restoring(self, rec: JobRecord) -> None:
        s = self.settings
        if rec.pending is None:
            return
        ref = InstanceRef.from_json(rec.pending)
        if ref.state is not InstanceState.RUNNING:
            try:
                ready = await self.provider.wait_ready(ref, s.ready_timeout_s)
            except ProviderError as exc:
                why = f"instance {ref.instance_id} did not come up: {exc}"
                await self._set(rec, self._abandon(ref, why))
                return

            def running(r: JobRecord) -> Change:
                r.pending = ready.to_json()
                return Change(r, f"instance {ready.instance_id} is running", note=True)

            await self._set(rec, running)
            return
        if time.time() > rec.since + s.restore_timeout_s:
            why = f"no restore report from {ref.instance_id} in {s.restore_timeout_s}s"
            await self._set(rec, self._abandon(ref, why))
            return
        # Liveness: a spot instance can be taken back (or a local VM die) before its agent
        # restored the job; nobody would report that, so ask the provider now and then.
        key = f"{rec.name}:{ref.instance_id}"
        now = time.monotonic()
        if now - self._checked.get(key, -s.liveness_s) < s.liveness_s:
            return
        self._checked = {key: now} | {
            k: v for k, v in self._checked.items() if not k.startswith(f"{rec.name}:")
        }
        cur = await self.provider.describe(ref)
        if cur.state in (InstanceState.TERMINATED, InstanceState.STOPPED):
            why = f"instance {ref.instance_id} is {cur.state.value} before the job was restored"
            log.warning("instance lost while restoring", extra={"job": rec.name, "reason": why})
            await self._set(rec, self._abandon(ref, why))

    async def _terminate_queued(self, rec: JobRecord) -> None:
        queued = list(rec.data.get("terminate") or [])
        if not queued:
            return
        done: list[str] = []
        for item in queued:
            ref = _ref_of(item, self.provider.name)
            if ref is not None:
                try:
                    await self.provider.terminate(ref)
                except PrecheckError as exc:
                    log.warning("terminate refused", extra={"job": rec.name, "error": str(exc)})
            done.append(json.dumps(item, sort_keys=True))

        def clear(r: JobRecord | None) -> Change | None:
            if r is None:
                return None
            left = [
                i for i in r.data.get("terminate", []) if json.dumps(i, sort_keys=True) not in done
            ]
            r.data["terminate"] = left
            ids = [i.get("instance_id") for i in queued]
            return Change(r, f"terminated old instance(s) {ids}", note=True)

        await self.db.change(rec.name, clear)

    async def _update_gauges(self) -> None:
        counts: dict[str, int] = {s.value: 0 for s in JobState}
        for rec in await self.db.jobs():
            counts[rec.state.value] += 1
        for k, v in counts.items():
            self.metrics.jobs.labels(k).set(v)
