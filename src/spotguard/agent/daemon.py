"""The agent daemon: notice sources → bus → policy → one checkpoint at a time per job → report.

Start-up, in order (each step one log line):

1. recover: a job left mid-checkpoint by a killed agent (an operation marker exists) is
   handed to the engine's ``recover`` so it runs again — never frozen, never locked; staged
   images a failed exit kept (:func:`spotguard.operations.kept_images`) are pushed again
   (:class:`~spotguard.agent.pusher.KeptPusher`) until durable;
2. instance facts from the metadata service (for reports and image metadata);
3. the assignment, if any and not done yet: restore the job, report RESTORING/RESTORED;
4. protect every job (``--job`` values and the restored one): a :class:`JobWorker` each;
5. the local API and the controller reporter; with a controller, a directive poll every
   ``directive_poll_s`` seconds per protected job (:mod:`spotguard.agent.directives`);
6. watch notices (the cloud's source, if any — ``cloud = none`` has none — and the manual
   drain source, through the bus).

A notice is counted, reported (NOTICE), decided by the :class:`Policy` and queued on every
active job. A cancelled notice drops what is still waiting. Azure events are acknowledged once
every job's image for them is durable (at once when the policy does nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spotguard import operations
from spotguard.checkpoint.jobs import JobInfo, list_jobs
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.contracts import AgentEvent, EventKind
from spotguard.errors import NoticeError, SpotguardError
from spotguard.facts import InstanceFacts
from spotguard.image import ImageSettings, latest_image
from spotguard.notices.base import Cloud, Notice, NoticeSource
from spotguard.notices.bus import NoticeBus
from spotguard.notices.manual import ManualSource
from spotguard.notices.settings import NoticeSettings
from spotguard.planner import PlannerSettings

from . import targets
from .api import AgentApi, ensure_token
from .directives import DirectivePoller
from .metrics import AgentMetrics
from .policy import Action, Policy
from .pusher import KeptPusher
from .reporter import Reporter
from .restore import read_assignment, restore_assignment
from .settings import AgentSettings, read_secret
from .sources import cloud_sources, instance_facts
from .worker import JobWorker, Request

log = logging.getLogger(__name__)

LIVENESS_S = 1.0
RESOLVE_RETRY_S = 5.0


class Agent:
    """One agent process: protects jobs on this VM (see the module docstring)."""

    def __init__(
        self,
        settings: AgentSettings,
        checkpoint: CheckpointSettings,
        notices: NoticeSettings,
        *,
        image: ImageSettings | None = None,
        sources: Sequence[NoticeSource] | None = None,
        planner: PlannerSettings | None = None,
    ) -> None:
        self.settings = settings
        self.image_settings = image
        self.planner_settings = planner
        self.checkpoint_settings = checkpoint
        self.notice_settings = notices
        self.dir = checkpoint.state_dir / "agent"
        self.metrics = AgentMetrics()
        self.policy: Policy = settings.policy()
        self.manual = ManualSource()
        self._extra_sources = list(sources) if sources is not None else None
        self.workers: dict[str, JobWorker] = {}
        self.instance = InstanceFacts()
        self.cloud: str | None = None
        self.store = settings.store
        self.controller_url: str | None = None
        self.controller_token: str | None = None
        self.reporter: Reporter = self._reporter(settings.controller_url, None)
        self.pusher = KeptPusher(
            metrics=self.metrics,
            on_durable=self._kept_durable,
            image_settings=image,
            max_backoff_s=settings.push_retry_max_s,
        )
        self.directives: DirectivePoller | None = None
        self.api: AgentApi | None = None
        self.bus: NoticeBus | None = None
        self.notices_seen: list[dict[str, Any]] = []
        self._outcomes: dict[str, asyncio.Future[list[dict[str, Any]]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop = asyncio.Event()
        self._started = time.time()
        self._controller_drain = False

    # --- wiring ---------------------------------------------------------------------------

    def _reporter(self, url: str | None, token: str | None) -> Reporter:
        bearer = token or self.settings.controller_bearer()
        self.controller_url, self.controller_token = url, bearer
        return Reporter(
            url, bearer, self.dir / "outbox", metrics=self.metrics, on_answer=self._controller_says
        )

    def _controller_says(self, answer: dict[str, Any]) -> None:
        """The controller answers each event with what it wants next; ``drain`` (a migration
        waiting for a fresh image) starts an operator-style drain once."""
        if answer.get("action") != "drain" or self._controller_drain:
            return
        if not any(w.active for w in self.workers.values()):
            return
        self._controller_drain = True
        log.info(
            "controller asks for a drain",
            extra={"step": "drain", "job": answer.get("job"), "reason": answer.get("reason")},
        )
        self._spawn(
            self.drain(
                "controller: " + str(answer.get("reason") or "migrate"), wait=False, deadline_s=None
            ),
            "controller-drain",
        )

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Run until :meth:`request_stop` (or, with ``exit_when_done``, until no job is left)."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        assignment = read_assignment(self.settings.assignment)
        if assignment is not None:
            if not self.settings.controller_url and assignment.controller_url:
                self.reporter = self._reporter(
                    assignment.controller_url, assignment.controller_token
                )
            if assignment.store and self.store == AgentSettings.model_fields["store"].default:
                self.store = assignment.store
        await self.reporter.start()
        try:
            await self._recover()
            for kept in operations.kept_images(self.checkpoint_settings.state_dir):
                self.pusher.add(kept)
            self.cloud, sources = await cloud_sources(self.notice_settings, self._extra_sources)
            self.instance = await instance_facts(self.cloud, self.notice_settings)
            log.info(
                "agent starting",
                extra={
                    "step": "start",
                    "cloud": self.cloud or "none",
                    "store": self.store,
                    "instance": self.instance.to_json(),
                    "controller": self.reporter.url,
                },
            )
            token = ensure_token(
                self.dir,
                read_secret(self.settings.api_token, self.settings.api_token_file, "api_token"),
            )
            self.api = AgentApi(self, self.metrics, self.settings.api_listen, token)
            await self.api.start()
            specs = list(self.settings.job)
            if assignment is not None:
                restored = await restore_assignment(
                    assignment,
                    records=self.dir / "assignments",
                    restore=self._restore,
                    reporter=self.reporter,
                    instance=self.instance.to_json(),
                )
                if restored is not None and restored.job not in specs:
                    specs.append(restored.job)
            for spec in specs:
                self._spawn(self._protect(spec), f"protect-{spec}")
            self._poll_directives()
            self.bus = NoticeBus(
                [*sources, self.manual], backoff_max=self.notice_settings.backoff_max
            )
            self._spawn(self._watch(self.bus), "notices")
            await self._stop.wait()
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        """Let a running checkpoint finish (the job must not stay frozen), then stop."""
        busy = [w for w in self.workers.values() if w.state == "checkpointing"]
        if busy:
            log.info("waiting for running checkpoints before stopping", extra={"step": "stop"})
            await asyncio.gather(*(w.idle.wait() for w in busy))
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.pusher.aclose()
        if self.bus is not None:
            await self.bus.aclose()
        if self.api is not None:
            await self.api.aclose()
        await self.reporter.flush(2.0)
        await self.reporter.aclose()
        log.info("agent stopped", extra={"step": "stop"})

    # --- jobs -------------------------------------------------------------------------------

    async def _protect(self, spec: str) -> None:
        """Resolve ``spec`` (retrying: the job may start after the agent), then guard it."""
        state_dir = self.checkpoint_settings.state_dir
        warned = False
        while True:
            try:
                info = targets.resolve(spec, state_dir=state_dir)
                break
            except SpotguardError as exc:
                if not warned:
                    log.warning(
                        "job not found; retrying",
                        extra={"step": "job", "job": spec, "error": str(exc)},
                    )
                    self.metrics.failures.labels("job").inc()
                    warned = True
                await asyncio.sleep(RESOLVE_RETRY_S)
        if info.name in self.workers and self.workers[info.name].active:
            return
        if info.name in self.pusher.jobs():
            # Stopped by an exit whose image still waits for the store: nothing to protect.
            self._worker(info).state = "pushing"
            return
        last = await self._latest_image_time(info.name)
        worker = self._worker(info, last)
        log.info(
            "protecting job",
            extra={"step": "protect", "job": info.name, "pid": info.pid, "dir": str(info.dir)},
        )
        self.reporter.emit(
            AgentEvent(
                job=info.name,
                kind=EventKind.STARTED,
                instance=self.instance.to_json(),
                detail={"pid": info.pid, "store": self.store},
            )
        )
        watcher = self._spawn(self._liveness(worker), f"alive-{info.name}")
        try:
            await worker.run()
        finally:
            watcher.cancel()
        self._maybe_done()

    def _worker(self, info: JobInfo, last_image_at: float | None = None) -> JobWorker:
        worker = JobWorker(
            info.name,
            info.pid,
            lambda mode, deadline, meta, on_frozen: self._checkpoint(
                info, mode, deadline, meta, on_frozen
            ),
            reporter=self.reporter,
            metrics=self.metrics,
            instance=self.instance.to_json(),
            periodic_interval=self.settings.periodic_interval,
            last_image_at=last_image_at,
        )
        self.workers[info.name] = worker
        return worker

    def _kept_durable(
        self, kept: operations.KeptImage, result: operations.CheckpointResult
    ) -> None:
        """A kept image landed: report it as the DURABLE of the exit that stopped its job."""
        worker = self.workers.get(kept.job)
        if worker is None:  # kept by an earlier agent; the job is not protected here
            info = JobInfo(name=kept.job, pid=0, dir=self.checkpoint_settings.jobs_dir / kept.job)
            worker = self._worker(info)
        notice = kept.meta.get("notice")
        worker.kept_durable(result, notice if isinstance(notice, dict) else None)
        self._maybe_done()

    def _poll_directives(self) -> None:
        """Ask the controller what it wants from each protected job, every
        ``directive_poll_s`` seconds (off without a controller or with 0)."""
        if not self.controller_url or self.settings.directive_poll_s <= 0:
            return
        self.directives = DirectivePoller(
            self.controller_url,
            self.controller_token,
            lambda: [w.name for w in self.workers.values() if w.active],
            self._controller_says,
            interval_s=self.settings.directive_poll_s,
        )
        self._spawn(self.directives.run(), "directives")

    async def _liveness(self, worker: JobWorker) -> None:
        while worker.active:
            if worker.state == "protecting" and not worker.alive():
                worker.job_ended()
                return
            await asyncio.sleep(LIVENESS_S)

    def _maybe_done(self) -> None:
        if (
            self.settings.exit_when_done
            and self.workers
            and not any(w.active for w in self.workers.values())
            and not self.pusher.jobs()
        ):
            log.info("no job left to protect; stopping", extra={"step": "stop"})
            self.request_stop()

    def _marker(self, job: str) -> Path:
        return self.dir / "ops" / f"{job}.json"

    async def _checkpoint(
        self,
        info: JobInfo,
        mode: str,
        deadline: datetime | None,
        meta: dict[str, Any],
        on_frozen: operations.OnFrozen,
    ) -> operations.CheckpointResult:
        marker = self._marker(info.name)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(
            json.dumps({"job": info.to_json(), "mode": mode, "started": time.time(), **meta})
        )
        try:
            return await operations.checkpoint(
                info,
                self.store,
                mode=mode,
                settings=self.checkpoint_settings,
                image_settings=self.image_settings,
                planner_settings=self.planner_settings,
                deadline=deadline,
                instance=self.instance,
                meta=meta,
                on_frozen=on_frozen,
            )
        except Exception:
            kept = operations.kept_images(self.checkpoint_settings.state_dir, job=info.name)
            if mode == "exit" and kept:
                # The job was stopped and its image is kept here: push it until it lands.
                self.workers[info.name].pushing = True
                for k in kept:
                    self.pusher.add(k)
            raise
        finally:
            marker.unlink(missing_ok=True)

    async def _restore(self, image_url: str, job: str) -> operations.RestoreResult:
        return await operations.restore(
            image_url,
            settings=self.checkpoint_settings,
            image_settings=self.image_settings,
            job_name=job,
        )

    async def _latest_image_time(self, job: str) -> float | None:
        """When the newest complete image of ``job`` was taken (from its sortable id)."""
        try:
            url = await latest_image(self.store, job, settings=self.image_settings)
        except SpotguardError as exc:
            self.metrics.failures.labels("store").inc()
            log.warning(
                "store unavailable; cannot tell the newest image's age",
                extra={"step": "store", "job": job, "error": str(exc)},
            )
            return None
        if url is None:
            return None
        image_id = url.rstrip("/").rsplit("/", 1)[-1]
        try:
            at = datetime.strptime(image_id.split("-", 1)[0], "%Y%m%dT%H%M%S%fZ")
        except ValueError:
            return None
        stamp = at.replace(tzinfo=UTC).timestamp()
        self.metrics.image_durable(job, stamp)
        return stamp

    async def _recover(self) -> None:
        """Bring back every job a killed agent (or CLI) left mid-checkpoint: the engine's
        ``recover`` for each job under the state dir and each job with an agent marker."""
        ops_dir = self.dir / "ops"
        interrupted: dict[str, dict[str, Any]] = {}
        for marker in sorted(ops_dir.glob("*.json")) if ops_dir.is_dir() else []:
            try:
                data = json.loads(marker.read_text())
                interrupted[JobInfo.from_json(data["job"]).name] = data
            except (OSError, ValueError, KeyError) as exc:
                log.warning(
                    "unreadable operation marker dropped",
                    extra={"step": "recover", "file": str(marker), "error": str(exc)},
                )
            marker.unlink(missing_ok=True)
        jobs = {j.name: j for j in list_jobs(self.checkpoint_settings.state_dir)}
        for name, data in interrupted.items():
            jobs.setdefault(name, JobInfo.from_json(data["job"]))
        for info in jobs.values():
            t0 = time.monotonic()
            try:
                thawed = await operations.recover(info, settings=self.checkpoint_settings)
            except SpotguardError as exc:
                self.metrics.failures.labels("recover").inc()
                log.error(
                    "recovery failed",
                    extra={"step": "recover", "job": info.name, "error": str(exc)},
                )
                continue
            if not thawed and info.name not in interrupted:
                continue
            data = interrupted.get(info.name, {})
            log.info(
                "recovered job left mid-checkpoint",
                extra={
                    "step": "recover",
                    "job": info.name,
                    "thawed": thawed,
                    "interrupted": data.get("mode"),
                    "seconds": round(time.monotonic() - t0, 3),
                },
            )
            self.reporter.emit(
                AgentEvent(
                    job=info.name,
                    kind=EventKind.CHECKPOINT_FAILED,
                    error="the agent stopped during a checkpoint; the job runs on",
                    detail={"step": "recover", "thawed": thawed, "interrupted": data.get("mode")},
                )
            )

    # --- notices ----------------------------------------------------------------------------

    async def _watch(self, bus: NoticeBus) -> None:
        async with bus:
            async for notice in bus:
                try:
                    self.handle(notice)
                except Exception as exc:  # one bad notice must not stop the agent
                    self.metrics.failures.labels("notice").inc()
                    log.error(
                        "notice could not be handled",
                        exc_info=exc,
                        extra={"step": "notice", "notice": notice.id},
                    )

    def handle(self, notice: Notice) -> None:
        """Count, report, decide and queue one notice (or drop a cancelled one)."""
        self.metrics.notices.labels(notice.cloud.value, notice.kind.value).inc()
        self.notices_seen.append(notice.to_json())
        del self.notices_seen[:-50]
        decision = self.policy.decide(notice)
        log.info(
            "notice received",
            extra={
                "step": "notice",
                "notice": notice.id,
                "cloud": notice.cloud.value,
                "kind": notice.kind.value,
                "action": notice.action,
                "deadline": notice.deadline.isoformat(),
                "seconds_left": round(notice.seconds_left(), 3),
                "cancelled": notice.cancelled,
                "decision": decision.action.value,
                "start_at": decision.start_at.isoformat(),
            },
        )
        jobs = [w for w in self.workers.values() if w.active]
        for w in jobs:
            self.reporter.emit(
                AgentEvent(
                    job=w.name,
                    kind=EventKind.NOTICE,
                    instance=self.instance.to_json(),
                    notice=notice.to_json(),
                    detail={"decision": decision.action.value, "reason": decision.reason},
                )
            )
        if notice.cancelled:
            for w in jobs:
                if not w.cancel(notice.id) and w.activity and w.activity["notice"] == notice.id:
                    log.info(
                        "notice cancelled after the freeze started; finishing it",
                        extra={"step": "cancel", "job": w.name, "notice": notice.id},
                    )
            self._settle(notice.id, [{"cancelled": True}])
            return
        if decision.action is Action.NONE or not jobs:
            self._spawn(self._acknowledge(notice), f"ack-{notice.id}")
            self._settle(notice.id, [{"job": w.name, "action": "none"} for w in jobs])
            return
        waiters: list[asyncio.Future[dict[str, Any]]] = []
        loop = asyncio.get_running_loop()
        for w in jobs:
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            waiters.append(fut)
            w.submit(
                Request(
                    notice.id,
                    decision.action,
                    decision.start_at,
                    decision.reason,
                    notice=notice,
                    waiters=[fut],
                )
            )
        self._spawn(self._after(notice, waiters), f"after-{notice.id}")

    async def _after(self, notice: Notice, waiters: list[asyncio.Future[dict[str, Any]]]) -> None:
        results = list(await asyncio.gather(*waiters))
        if not any(r.get("cancelled") for r in results):
            await self._acknowledge(notice)
        self._settle(notice.id, results)
        self._maybe_done()

    def _settle(self, notice_id: str, results: list[dict[str, Any]]) -> None:
        fut = self._outcomes.get(notice_id)
        if fut is not None and not fut.done():
            fut.set_result(results)

    async def _acknowledge(self, notice: Notice) -> None:
        if self.bus is None or notice.cloud is not Cloud.AZURE:
            return
        try:
            await self.bus.acknowledge(notice)
        except NoticeError as exc:
            self.metrics.failures.labels("acknowledge").inc()
            log.warning(
                "notice acknowledgement failed",
                extra={"step": "acknowledge", "notice": notice.id, "error": str(exc)},
            )

    # --- local API --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "agent": {
                "pid": os.getpid(),
                "started": datetime.fromtimestamp(self._started, UTC).isoformat(),
                "cloud": self.cloud,
                "store": self.store,
                "controller": self.reporter.url,
                "reports_pending": len(self.reporter.pending()),
                "instance": self.instance.to_json(),
                "kept_images": self.pusher.status(),
                "directive_polls": self.directives.polls if self.directives else 0,
            },
            "jobs": [
                {**w.status(), "kept": self.pusher.status(w.name)} for w in self.workers.values()
            ],
            "notices": list(self.notices_seen),
            "sources": (
                {n: vars(h) for n, h in self.bus.health.items()} if self.bus is not None else {}
            ),
        }

    async def drain(self, reason: str, *, wait: bool, deadline_s: float | None) -> dict[str, Any]:
        """Operator drain of every protected job: a manual notice through the bus (so it is
        deduplicated, logged and decided like any other); with ``wait``, the outcomes."""
        notice = await self.manual.drain(reason, deadline_s or self.settings.drain_deadline)
        fut: asyncio.Future[list[dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self._outcomes[notice.id] = fut
        answer: dict[str, Any] = {"notice": notice.to_json()}
        if wait:
            answer["results"] = await fut
            self._outcomes.pop(notice.id, None)
        return answer
