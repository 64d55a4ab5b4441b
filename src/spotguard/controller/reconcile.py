"""The reconcile side of the controller: one loop per job does what takes time, one step per
wake-up, persisting before every side effect.

* INTERRUPTING past deadline + grace (or the job left without an image) → the store's newest
  complete image (:func:`spotguard.image.latest_image`) → LAUNCHING, else FAILED — only for a
  notice that ends the VM (:meth:`~spotguard.controller.state.JobData.ends_vm`); any other
  notice past its deadline returns the job to PROTECTED (it was never stopped).
* CHECKPOINTED past deadline + grace → LAUNCHING (the VM is gone without saying so), unless
  the job's agent was heard from after the deadline (an event or a directive poll from the
  job's instance): then the job still runs there and is PROTECTED again.
* LAUNCHING → a round token is persisted first; with one already persisted (a restart
  mid-launch) the provider is asked for the instance tagged with it before anything is
  launched. A round after a restore failed for the image's fault (``ImageCorrupt``, a missing
  image) first picks the newest complete image older than every image known bad, saying so,
  or FAILS when there is none. Then the strategy's candidates are tried in order, each
  attempt's index persisted before the call: capacity errors move on, precheck errors give up.
  Each launched instance gets an assignment with the job's ownership epoch and a VM token
  scoped to it.
* RESTORING → wait until the instance runs; past ``restore_timeout_s`` without the agent's
  RESTORED → terminate it and start a new round (a new epoch).

Old instances queued for termination are terminated by the loop, whatever the state.

:class:`Reconciler` owns the loops (one task per job: ``ensure``, ``wake``, ``stop``) and
holds its collaborators: the state DB, the provider, the strategy, the metrics, the token
keys, and :class:`~spotguard.controller.images.ImageChoice` (given ``persist`` as its only
way to write). The :class:`~spotguard.controller.core.Controller` holds the reconciler and
tells it which jobs to look at now (``ensure``, ``wake``) and when a job's agent was heard
(``hear``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any

from spotguard.contracts import Assignment
from spotguard.controller.images import ImageChoice, Mutate, failed, store_of
from spotguard.controller.machine import settle_early_report
from spotguard.controller.metrics import Metrics
from spotguard.controller.ownership import new_epoch, relaunch
from spotguard.controller.settings import ControllerSettings
from spotguard.controller.state import TERMINAL, Change, JobRecord, JobState, StateDB
from spotguard.controller.strategies import Strategy
from spotguard.controller.tokens import TokenKeys
from spotguard.errors import (
    CapacityError,
    NoMatchingOffer,
    PrecheckError,
    ProviderError,
    SpotguardError,
    UnknownInstanceType,
)
from spotguard.image.settings import ImageSettings
from spotguard.providers.base import (
    CloudProvider,
    InstanceRef,
    InstanceState,
    LaunchSpec,
    Market,
    Offer,
)

log = logging.getLogger(__name__)


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


def _runs_on(why: str) -> Mutate:
    """A change back to PROTECTED: the job was not stopped by the notice."""

    def mutate(r: JobRecord) -> Change:
        r.state = JobState.PROTECTED
        r.deadline = None
        reason = f"the job still runs: {why}"
        return Change(r, reason)

    return mutate


def report_crash(task: asyncio.Task[None]) -> None:
    """Log a task that died of an unexpected error (a job's loop: the next event restarts
    it; a notice source)."""
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        log.error("job loop crashed", extra={"task": task.get_name(), "error": repr(exc)})


class Reconciler:
    """The per-job loops of a controller (see the module doc)."""

    def __init__(
        self,
        settings: ControllerSettings,
        db: StateDB,
        provider: CloudProvider,
        *,
        strategy: Strategy,
        metrics: Metrics,
        image_settings: ImageSettings,
        keys: TokenKeys,
        public_url: str,
    ) -> None:
        self.settings = settings
        self.db = db
        self.provider = provider
        self.strategy = strategy
        self.metrics = metrics
        self.keys = keys
        #: what new instances report to (the server sets the bound port when on :0)
        self.public_url = public_url
        self.image_choice = ImageChoice(settings, image_settings, self.persist)
        self._running = False
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._checked: dict[str, float] = {}  # "<job>:<instance>" → last liveness check
        self._heard: dict[str, float] = {}  # job → when its agent last reported or polled

    # ----- what the controller asks of it --------------------------------------------------

    def start(self) -> None:
        """Let loops run (:meth:`ensure` starts one per job)."""
        self._running = True

    @property
    def running(self) -> bool:
        return self._running

    def ensure(self, name: str) -> None:
        """Start job ``name``'s loop unless it runs."""
        task = self._loops.get(name)
        if task is None or task.done():
            self._wake.setdefault(name, asyncio.Event())
            task = asyncio.create_task(self._loop(name), name=f"job:{name}")
            task.add_done_callback(report_crash)
            self._loops[name] = task

    def wake(self, name: str) -> None:
        """Let job ``name``'s loop take its next step now, not at the next tick."""
        ev = self._wake.get(name)
        if ev is not None:
            ev.set()

    def hear(self, name: str) -> None:
        """The job's agent spoke just now (an event from its instance, a directive poll)."""
        self._heard[name] = time.time()

    async def stop(self) -> None:
        """Stop every loop (each persists before it acts: a restart resumes from the DB)."""
        self._running = False
        loops = list(self._loops.values())
        for t in loops:
            t.cancel()
        for t in loops:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._loops.clear()

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
            await self.update_gauges()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self.settings.tick_s)

    async def _step(self, rec: JobRecord) -> None:
        now = time.time()
        s = self.settings
        if rec.state is JobState.INTERRUPTING:
            at_once = rec.data.fallback_now
            due = (rec.deadline or now) + (0 if at_once else s.notice_grace_s)
            if now >= due and (at_once or rec.data.ends_vm()):
                await self.image_choice.fallback(rec)
            elif now >= due:
                why = "the notice's deadline passed; nothing stopped it"
                await self.persist(rec, _runs_on(why))
        elif rec.state is JobState.CHECKPOINTED:
            deadline = rec.deadline
            if deadline is not None and self._heard.get(rec.name, 0.0) > deadline:
                await self.persist(
                    rec, _runs_on("its agent reported after the notice's deadline; it runs on")
                )
            elif deadline is not None and now >= deadline + s.notice_grace_s:
                await self.persist(
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

    async def persist(
        self, rec: JobRecord, mutate: Mutate, *, expect: JobState | None = None
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

    def assignment(self, rec: JobRecord, offer_hint: dict[str, Any]) -> Assignment:
        """The assignment a launched VM gets: the image, the store, and a VM token scoped to
        the job's current epoch."""
        store = store_of(rec, self.settings.default_store)
        if rec.image_url is None or store is None:
            raise PrecheckError(f"job {rec.name!r} has no image to restore")
        epoch = rec.data.owner.epoch
        return Assignment(
            job=rec.name,
            image_url=rec.image_url,
            store=store,
            controller_url=self.public_url,
            controller_token=self.keys.issue(rec.name, epoch),
            insecure_controller=self.settings.insecure_listen,
            attempt=rec.restarts,
            epoch=epoch,
            instance_hint=offer_hint,
            keys=self.settings.vm_key_sources(rec.name),
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
                    return settle_early_report(Change(r, r.reason, {"instance": ref.to_json()}))

                await self.persist(rec, adopt)
                return
        else:
            if rec.data.failed_rounds >= s.max_restarts:
                why = (
                    f"max restarts ({s.max_restarts}) reached: {rec.data.failed_rounds} "
                    "relaunch rounds in a row did not restore the job; 'spotguard jobs retry "
                    f"{rec.name}' tries again"
                )
                await self.persist(rec, failed(why))
                return
            if rec.data.older_image:
                older = await self.image_choice.older_image(rec)
                if older is None:
                    return
                rec = older
            rec = await self.image_choice.spec_from_image(rec)
            token = uuid.uuid4().hex[:16]

            def begin(r: JobRecord) -> Change:
                r.launch_token = token
                r.launch_attempt = 0
                r.restarts += 1
                r.data.failed_rounds += 1
                why = f"launch round {r.restarts} (token {token}; {r.data.failed_rounds} in a row)"
                return Change(r, why, note=True)

            await self.persist(rec, begin)
            got = await self.db.get(rec.name)
            if got is None or got.launch_token != token:
                return
            rec = got
        target = rec.data.target or {}
        spec = LaunchSpec.from_json(rec.spec).retarget(
            region=target.get("region"), instance_type=target.get("type")
        )
        try:
            offers = await self.provider.offers(spec)
        except (PrecheckError, UnknownInstanceType) as exc:
            await self.persist(rec, failed(str(exc)))
            return
        cands = self.strategy.candidates(
            spec,
            offers,
            on_demand_fallback=s.on_demand_fallback,
            types_per_zone=s.types_per_zone,
            limit=s.max_candidates,
        )
        skip = set(rec.data.skip_offers)
        if skip:  # offers whose instance was lost this interruption go last-resort only
            cands = [c for c in cands if c.label() not in skip] or cands
        if not cands:
            where = target.get("region") or ", ".join(self.provider.regions())
            why = f"no offer matches {spec.describe_gpus()} anywhere in {where}"
            await self.persist(rec, failed(str(NoMatchingOffer(why))))
            return
        round_token = rec.launch_token
        assert round_token is not None
        for i in range(rec.launch_attempt, len(cands)):
            if not await self._attempt(rec, round_token, i, cands[i], len(cands)):
                return
        # Every candidate lacked capacity.
        rounds = rec.data.capacity_rounds + 1
        if rounds >= s.capacity_rounds:
            await self.persist(
                rec,
                failed(f"no capacity in any of {len(cands)} offers after {rounds} passes"),
            )
            return

        def again(r: JobRecord) -> Change:
            r.data.capacity_rounds = rounds
            r.launch_attempt = 0
            return Change(r, f"no capacity anywhere (pass {rounds}); retrying later", note=True)

        await self.persist(rec, again)
        await asyncio.sleep(s.capacity_retry_s)

    async def _attempt(self, rec: JobRecord, token: str, i: int, offer: Offer, n: int) -> bool:
        """Launch attempt ``i`` of a round; ``True`` means "try the next candidate"."""

        def attempt(r: JobRecord) -> Change:
            r.launch_attempt = i
            r.data.offer = offer.to_json()
            return Change(r, f"attempt {i + 1}/{n}: {offer.label()}", note=True)

        if await self.persist(rec, attempt) is None:
            return False  # the job moved on meanwhile
        hint = {**offer.to_json(), "launch_token": token}
        try:
            ref = await self.provider.launch(
                offer, self.assignment(rec, hint), client_token=f"{token}-{i}"
            )
        except CapacityError as exc:
            self.metrics.launches.labels("capacity").inc()
            msg = f"no capacity: {offer.label()}: {exc}"
            await self.persist(rec, lambda r: Change(r, msg, note=True))
            return True
        except (PrecheckError, UnknownInstanceType) as exc:
            self.metrics.launches.labels("precheck").inc()
            await self.persist(rec, failed(f"launch refused: {exc}"))
            return False
        except ProviderError as exc:
            self.metrics.launches.labels("error").inc()
            msg = f"launch error (retrying): {exc}"
            await self.persist(rec, lambda r: Change(r, msg, note=True))
            return False
        self.metrics.launches.labels("launched").inc()

        def up(r: JobRecord) -> Change:
            r.state = JobState.RESTORING
            r.pending = ref.to_json()
            r.data.target = None
            r.data.action = None
            r.data.owner = r.data.owner.model_copy(update={"instance_id": ref.instance_id})
            r.reason = f"launched {ref.instance_id} ({offer.label()}); assignment delivered"
            return settle_early_report(Change(r, r.reason, {"instance": ref.to_json()}))

        if await self.persist(rec, up) is None:
            log.warning("job moved on during launch; terminating", extra={"job": rec.name})
            await self.provider.terminate(ref)
        return False

    @staticmethod
    def _abandon(ref: InstanceRef, reason: str) -> Mutate:
        """A failed attempt: queue ``ref`` for termination and start a new round (counted
        against ``max_restarts``, the rounds in a row without a restore) that tries the
        other offers before this one's."""

        def mutate(r: JobRecord) -> Change:
            r.data.terminate = [*r.data.terminate, ref.to_json()]
            label = f"{ref.instance_type}@{ref.zone}/{ref.market.value}"
            if label not in r.data.skip_offers:
                r.data.skip_offers = [*r.data.skip_offers, label]
            new_epoch(r)  # the abandoned instance's agent may no longer report
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
                await self.persist(rec, self._abandon(ref, why))
                return

            def running(r: JobRecord) -> Change:
                r.pending = ready.to_json()
                return Change(r, f"instance {ready.instance_id} is running", note=True)

            await self.persist(rec, running)
            return
        if time.time() > rec.since + s.restore_timeout_s:
            why = f"no restore report from {ref.instance_id} in {s.restore_timeout_s}s"
            await self.persist(rec, self._abandon(ref, why))
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
            why += f": {cur.state_reason}" if cur.state_reason else ""  # the provider's why
            log.warning("instance lost while restoring", extra={"job": rec.name, "reason": why})
            await self.persist(rec, self._abandon(ref, why))

    async def _terminate_queued(self, rec: JobRecord) -> None:
        queued = list(rec.data.terminate)
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
            left = [i for i in r.data.terminate if json.dumps(i, sort_keys=True) not in done]
            r.data.terminate = left
            ids = [i.get("instance_id") for i in queued]
            return Change(r, f"terminated old instance(s) {ids}", note=True)

        await self.db.change(rec.name, clear)

    async def update_gauges(self) -> None:
        """Jobs by state, into the metrics."""
        counts: dict[str, int] = {s.value: 0 for s in JobState}
        for rec in await self.db.jobs():
            counts[rec.state.value] += 1
        for k, v in counts.items():
            self.metrics.jobs.labels(k).set(v)
