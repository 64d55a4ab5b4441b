"""The agent daemon: notice sources → bus → policy → one checkpoint at a time per job → report.

Start-up, in order (each step one log line; :mod:`spotguard.agent.startup`):

1. lock the state dir (one agent per state dir) and check the store URL (usable here, its
   SDK installed): the agent refuses to start rather than fail at the first notice;
2. recover: a job left mid-freeze by a killed agent (the engine's marker exists) is brought
   back by the engine's ``recover`` — never frozen, never locked; staged images not durable yet
   (:class:`spotguard.operations.KeptImages`: recorded, or orphaned and adopted) are pushed to
   the configured store (:class:`~spotguard.agent.pusher.KeptPusher`) until durable;
3. instance facts from the metadata service (for reports and image metadata);
4. the assignment, if any and not done yet: restore the job, report RESTORING/RESTORED;
5. protect every job (``--job`` values and the restored one): a :class:`JobWorker` each. A job
   this agent stopped with an exit checkpoint (its :mod:`.ledger` says so) is not "finished
   by itself"; one whose newest image another instance wrote, or that another agent protects
   (:mod:`.joblock`), is left alone; one named by name is protected again when it comes back;
6. the local API and the controller reporter; with a controller, a directive poll per job
   (:mod:`.directives`); for a job owned elsewhere the agent stands down (:mod:`.standdown`);
   a job started with ``--nccl-group`` is frozen when another of its group is (:mod:`.groups`);
7. watch notices (:mod:`spotguard.agent.dispatch`) and run the park policies
   (:mod:`spotguard.agent.parking`; a job parked as an image is not "finished").

The :class:`Agent` composes objects built with what each works with — the notice dispatcher,
the node's parks and park policy, a :class:`JobWorker` per job, reporter, pusher, directive
poll — none reaches into the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Coroutine, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from spotguard import operations
from spotguard.checkpoint import proctree, scan
from spotguard.checkpoint.engine import Engine
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.config import ConfigFile
from spotguard.container.guard import ContainerJobs
from spotguard.contracts import Directive, InstanceInfo, Mode, StartedEvent
from spotguard.errors import AgentNotRunning, AgentTaskDied, SpotguardError
from spotguard.facts import InstanceFacts
from spotguard.image import ImageSettings
from spotguard.notices.base import NoticeSource
from spotguard.notices.bus import NoticeBus
from spotguard.notices.manual import ManualSource
from spotguard.notices.settings import NoticeSettings
from spotguard.notify import Notifier
from spotguard.park.settings import ParkSettings
from spotguard.planner import PlannerSettings

from . import discovery, groups, identity, joblock, jobspec, journal, parking, recent, startup
from .api import AgentApi, ensure_token
from .directives import DirectivePoller
from .dispatch import NoticeDispatcher
from .jobstate import JobState
from .ledger import Ledger, newest_known, runs_elsewhere, stood_down
from .metrics import AgentMetrics
from .policy import Policy
from .pusher import KeptPusher
from .reporter import Reporter
from .restore import read_assignment, restore_assignment
from .settings import AgentSettings, read_secret
from .sources import cloud_sources, instance_facts
from .worker import JobWorker

log = logging.getLogger(__name__)

LIVENESS_S = 1.0
RESOLVE_RETRY_S = 5.0


class Agent:
    """One agent process: protects jobs on this VM (see the module docstring). Every
    settings group is loaded once by the caller (``spotguard agent``) and passed in."""

    def __init__(
        self,
        settings: AgentSettings,
        checkpoint: CheckpointSettings,
        notices: NoticeSettings,
        *,
        image: ImageSettings,
        planner: PlannerSettings | None = None,
        sources: Sequence[NoticeSource] | None = None,
        notifier: Notifier | None = None,
        park: ParkSettings | None = None,
        config: str | None = None,  # the --config file, for processes the agent starts
        config_file: ConfigFile | None = None,  # that file as the command read it
    ) -> None:
        self.settings = settings
        self.park_settings = park or ParkSettings()
        self.config = config
        self.config_file = config_file
        self.notifier = notifier  # webhooks told of notices, freezes, images, restores
        self.image_settings = image
        self.planner_settings = planner
        self.checkpoint_settings = checkpoint
        self.notice_settings = notices
        self.layout = checkpoint.layout  # every path under the state dir
        self.dir = self.layout.agent
        self.metrics = AgentMetrics()
        self.metrics.count_protected(lambda: sum(w.active for w in self.workers.values()))
        self.policy: Policy = settings.policy()
        self.manual = ManualSource()
        self._extra_sources = list(sources) if sources is not None else None
        self.workers: dict[str, JobWorker] = {}
        self.epochs: dict[str, int] = {}  # ownership epoch of each job an assignment gave us
        self.ledger = Ledger(self.layout.ledger)
        self.kept = operations.kept_images_of(checkpoint)
        self._engine: Engine | None = None  # made at first use: a bad CRIU fails that use
        self.instance = InstanceFacts()
        self.cloud: str | None = None
        self.store = settings.store
        self.controller_url: str | None = None
        self.controller_token: str | None = None
        self.recent = recent.RecentEvents()  # for the web page (GET /events)
        self.reporter: Reporter = self._reporter(settings.controller_url, None)
        self.pusher = KeptPusher(
            metrics=self.metrics, on_durable=self._kept_durable, store_url=self.store,
            images=self.kept, image_settings=image, instance=lambda: self.instance,
            max_backoff_s=settings.push_retry_max_s)  # fmt: skip
        self.directives: DirectivePoller | None = None
        self.api: AgentApi | None = None
        self.bus: NoticeBus | None = None
        self.notices: NoticeDispatcher | None = None  # built once the wiring is known
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop = asyncio.Event()
        self._started = time.time()
        self._lock: IO[str] | None = None
        self.died: AgentTaskDied | None = None

    # --- wiring ---------------------------------------------------------------------------

    def _reporter(self, url: str | None, token: str | None, insecure: bool = False) -> Reporter:
        bearer = token or self.settings.controller_bearer()
        self.controller_url, self.controller_token = url, bearer
        told = self.recent.tee(self.notifier.agent_event if self.notifier is not None else None)
        return Reporter(
            url, bearer, self.layout.outbox, metrics=self.metrics,
            on_answer=self._controller_says, on_emit=told,
            insecure=insecure or self.settings.insecure_controller,
        )  # fmt: skip

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._supervise)
        return task

    def _supervise(self, task: asyncio.Task[Any]) -> None:
        """No task dies silently: one that raised is logged and stops the agent, whose
        ``run`` then raises :class:`AgentTaskDied` (non-zero exit: systemd restarts it)."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        self.metrics.failures.labels("internal").inc()
        log.error(
            "agent task died; stopping the agent",
            exc_info=exc if not isinstance(exc, SpotguardError) else None,
            extra={"step": "stop", "task": task.get_name(), "error": str(exc)},
        )
        if self.died is None:
            self.died = AgentTaskDied(f"agent task {task.get_name()} died: {exc}")
            self.died.__cause__ = exc
        self.request_stop()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Run until :meth:`request_stop` (or, with ``exit_when_done``, until no job is left).
        Raises :class:`~spotguard.errors.ConfigError` before anything else when this agent
        cannot work (another agent on the state dir, an unusable store)."""
        self._lock = startup.lock_state_dir(self.layout)
        try:
            assignment = read_assignment(self.settings.assignment)
            if assignment is not None:
                if not self.settings.controller_url and assignment.controller_url:
                    self.reporter = self._reporter(
                        assignment.controller_url, assignment.controller_token,
                        assignment.insecure_controller,
                    )  # fmt: skip
                if assignment.store and self.store == AgentSettings.model_fields["store"].default:
                    self.store = self.pusher.store_url = assignment.store
            named = [*([assignment.job] if assignment else []), *self.settings.job]  # its prefix
            self.store = await startup.check_store(self.store, self.image_settings, named)
            self.pusher.store_url = self.store  # a file:// store's links resolved, once
            await self.reporter.start()
            try:
                await self._start(assignment)
                await self._stop.wait()
            finally:
                await self._shutdown()
        finally:
            self._lock.close()
        if self.died is not None:
            raise self.died

    async def _start(self, assignment: Any) -> None:
        self._spawn(startup.warm_gpu(self.settings.transparent_hugepages), "warm-gpu")
        recovered = startup.report_recovered(self.reporter, self.metrics)
        await startup.recover_interrupted(self.checkpoint_settings, recovered, self.park_settings)
        self.pusher.add_all(self.kept.scan())
        self.cloud, sources = await cloud_sources(self.notice_settings, self._extra_sources)
        self.instance = await instance_facts(self.cloud, self.notice_settings)
        log.info("agent starting", extra={
            "step": "start", "cloud": self.cloud or "none", "store": self.store,
            "instance": self.instance.to_json(), "controller": self.reporter.url,
        })  # fmt: skip
        self.notices = self._dispatcher()
        self.containers = ContainerJobs(  # jobs named podman:NAME (spotguard.container.guard)
            self.notices, self.workers, self._maybe_done, self.settings, self.checkpoint_settings,
            self.image_settings, store=self.store, config=self.config,
            config_file=self.config_file)  # fmt: skip
        token = ensure_token(
            self.layout.api_token,
            read_secret(self.settings.api_token, self.settings.api_token_file, "api_token"),
        )
        self.api = AgentApi(self, self.metrics, self.settings.api_listen, token)
        await self.api.start()
        specs = list(self.settings.job)
        if assignment is not None:
            restored = await restore_assignment(
                assignment,
                records=self.layout.assignments,
                restore=self.containers.restoring(self._restore),
                reporter=self.reporter,
                instance=self.instance.to_json(),
            )
            if restored is not None:  # the job is ours under the assignment's epoch
                self.epochs[restored.job] = assignment.epoch
                specs += [restored.job] if restored.job not in specs else []
        for spec in specs:
            self._protect_later(spec)
        self._spawn(startup.warm_memory(self.settings.warm_memory, self._state_dir), "warm")
        if self.settings.discover_jobs:  # jobs started by `spotguard run`
            taken, every = (lambda: [*specs, *self.workers]), self.settings.discover_interval_s
            found = discovery.watch(self._state_dir, taken, self._protect_later, every)
            self._spawn(found, "discover")
        self.directives = DirectivePoller.start(  # what the controller wants from each job
            self.controller_url, self.controller_token, self.settings.directive_poll_s,
            lambda: [w.name for w in self.workers.values() if w.active], self._controller_says,
            self.epochs.get, self._spawn,
        )  # fmt: skip
        self.bus = NoticeBus([*sources, self.manual], backoff_max=self.notice_settings.backoff_max)
        self._spawn(self.notices.watch(self.bus), "notices")
        self._spawn(self.recent.watch_parks(self._state_dir), "recent-parks")
        self.metrics.count_parked(self._state_dir)
        policy = parking.park_policy(
            self.workers, checkpoint=self.checkpoint_settings, park=self.park_settings,
            image=self.image_settings, engine=self.engine(),
            agent=self.settings, notifier=self.notifier, config=self.config,
        )  # fmt: skip
        self._spawn(policy.run(self._stop), "park")

    def _dispatcher(self) -> NoticeDispatcher:
        """The notice handling, once the reporter, store and instance are known."""
        parks = parking.NodeParks(
            self._state_dir, store=self.store, image=self.image_settings,
            instance=self.instance, reporter=self.reporter, metrics=self.metrics,
        )  # fmt: skip
        return NoticeDispatcher(
            policy=self.policy, workers=self.workers, reporter=self.reporter,
            metrics=self.metrics, manual=self.manual, instance=self.instance, parks=parks,
            ledger=self.ledger, spawn=self._spawn, on_settled=self._maybe_done,
            drain_deadline=self.settings.drain_deadline,
        )  # fmt: skip

    @property
    def _state_dir(self) -> Path:
        return self.checkpoint_settings.state_dir

    def _protect_later(self, spec: str) -> None:
        self._spawn(self.containers.guard(spec) or self._protect(spec), f"protect-{spec}")

    def _controller_says(self, answer: Directive) -> None:
        """A controller's answer (report, directive poll): for the notice handling, if any."""
        if self.notices is not None:
            self.notices.controller_says(answer)

    async def drain(self, reason: str, *, wait: bool, deadline_s: float | None) -> dict[str, Any]:
        """Operator drain of every protected job (:meth:`NoticeDispatcher.drain`)."""
        if self.notices is None:
            raise AgentNotRunning("the agent is still starting; drain again in a moment")
        return await self.notices.drain(reason, wait=wait, deadline_s=deadline_s)

    @property
    def notices_seen(self) -> list[dict[str, Any]]:
        """The last notices seen (newest last)."""
        return self.notices.seen if self.notices is not None else []

    async def _shutdown(self) -> None:
        """Let a running checkpoint finish (the job must not stay frozen), then stop."""
        busy = [w for w in self.workers.values() if w.state is JobState.CHECKPOINTING]
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
        if self.notifier is not None:
            await self.notifier.aclose()
        log.info("agent stopped", extra={"step": "stop"})

    # --- jobs -------------------------------------------------------------------------------

    async def _protect(self, spec: str) -> None:
        """Guard the job ``spec`` names; a job named by name is watched after it ends and
        guarded again when it runs again (restored by hand, or by a new assignment)."""
        missing = self.metrics.failures.labels("job").inc
        info = await jobspec.resolve_when_up(spec, self._state_dir, RESOLVE_RETRY_S, missing)
        while True:
            seen = jobspec.incarnation(info)
            await self._guard(info)
            self._maybe_done()
            if not jobspec.by_name(spec):
                return
            info = await jobspec.comes_back(spec, seen, self._state_dir, RESOLVE_RETRY_S)

    async def _guard(self, info: JobInfo) -> None:
        current = self.workers.get(info.name)
        if current is not None and current.active:
            return
        if info.name in self.pusher.jobs():
            # Stopped by an exit whose image still waits for the store: nothing to protect.
            self._worker(info).move(JobState.PUSHING)
            return
        ident = identity.of_job(info, self.ledger.get(info.name))  # None: its process is gone
        if await journal.ended_by_us(
            info, ledger=self.ledger, store=self.store, instance=self.instance.to_json(),
            settings=self.image_settings, reporter=self.reporter, alive=ident is not None,
        ):  # fmt: skip
            self._worker(info).move(JobState.EXITED)
            return
        if ident is None and parking.is_parked(self.checkpoint_settings.state_dir, info.name):
            self._worker(info).move(JobState.PARKED)  # protected again once unparked
            return
        newest = await newest_known(self.store, info.name, self.image_settings, self.metrics)
        if stood_down(self.ledger, info) or await runs_elsewhere(
            self.ledger, info.name, newest, self.instance.instance_id, self.image_settings
        ):
            self._worker(info).move(JobState.STOOD_DOWN)
            self.ledger.put(info.name, info.pid, JobState.STOOD_DOWN)
            return
        if ident is None and proctree.alive(info.pid):  # a stranger was given the job's pid
            self._worker(info).job_ended()
            return
        held = joblock.take(ident, self._state_dir, self.settings.job_lock_dir)  # one agent/job
        if held.other is not None:
            self._worker(info).held_elsewhere(held.other)
            return
        worker = self._worker(info, newest[1] if newest is not None else None, ident)
        log.info(
            "protecting job",
            extra={"step": "protect", "job": info.name, "pid": info.pid, "dir": str(info.dir)},
        )
        self.ledger.put(info.name, info.pid, JobState.PROTECTING, ident=ident)
        where = InstanceInfo.model_validate(self.instance.to_json())
        started = StartedEvent(job=info.name, instance=where, pid=info.pid, store=self.store)
        self.reporter.emit(started)
        if self.notices is not None:  # notices that came before this job was protected
            self.notices.replay(worker)
        alive = parking.watch_alive(worker, self._state_dir, LIVENESS_S)
        watchers = [self._spawn(alive, f"alive-{info.name}")]
        drain = lambda why: self._spawn(self.drain(why, wait=False, deadline_s=None), "drain")  # noqa: E731
        on_freeze = groups.freeze_handler(drain, self.workers)
        if (group := groups.watch(info.pid, info.name, self._controller, on_freeze)) is not None:
            watchers.append(self._spawn(group, f"group-{info.name}"))
        try:
            await worker.run()
        finally:
            for w in watchers:
                w.cancel()
            held.release()

    @property
    def _controller(self) -> tuple[str | None, str | None]:
        return self.controller_url, self.controller_token

    def engine(self) -> Engine:
        """The agent's one engine, its NCCL groups meeting at the controller; made at first
        use: a CRIU that cannot run fails that restore or checkpoint, not the agent's start."""
        if self._engine is None:
            self._engine = operations.engine_for(self.checkpoint_settings)
            self._engine.nccl.peers = groups.peers_factory(lambda: self._controller)
        return self._engine

    def _worker(
        self, info: JobInfo, last: float | None = None, ident: identity.Identity | None = None
    ) -> JobWorker:  # ident: the job's process (pid and start time), None: pid only
        cs = self.checkpoint_settings
        worker = JobWorker(
            info.name, info.pid,
            lambda m, deadline, meta, f: self._checkpoint(info, m, deadline, meta, f),
            reporter=self.reporter, metrics=self.metrics, instance=self.instance.to_json(),
            periodic_interval=self.settings.periodic_interval, last_image_at=last, ident=ident,
            file_limits=scan.FileLimits(info.dir, cs.max_file_bytes, cs.ghost_limit),
            gives_way=lambda d: operations.exit_fits(info, self.store, settings=cs, deadline=d,
                planner_settings=self.planner_settings, engine=self.engine()),
        )  # fmt: skip
        self.workers[info.name] = worker
        return worker

    def _kept_durable(
        self, kept: operations.KeptImage, result: operations.CheckpointResult
    ) -> None:
        """A kept image landed: report it as the DURABLE of the checkpoint that made it."""
        worker = self.workers.get(kept.job)
        if worker is None:  # kept by an earlier agent; the job is not protected here
            info = JobInfo(name=kept.job, pid=0, dir=self.layout.job(kept.job))
            worker = self._worker(info)
        if result.mode is Mode.EXIT:
            self.ledger.put(
                kept.job, worker.pid, JobState.EXITED, image_url=result.image_url,
                image_at=result.frozen_at,
            )  # fmt: skip
        notice = kept.meta.get("notice")
        worker.kept_durable(result, notice if isinstance(notice, dict) else None)
        self._maybe_done()

    def _maybe_done(self) -> None:
        if (
            self.settings.exit_when_done
            and self.workers
            and not any(w.active for w in self.workers.values())
            and not self.pusher.jobs()
        ):
            log.info("no job left to protect; stopping", extra={"step": "stop"})
            self.request_stop()

    async def _checkpoint(
        self,
        info: JobInfo,
        mode: Mode,
        deadline: datetime | None,
        meta: dict[str, Any],
        on_frozen: operations.OnFrozen,
    ) -> operations.CheckpointResult:
        alive = self.workers[info.name].alive
        with journal.checkpointing(self.ledger, info, mode, alive) as outcome:  # intent, outcome
            try:
                result = await operations.checkpoint(
                    info, self.store, mode=mode, settings=self.checkpoint_settings,
                    image_settings=self.image_settings, planner_settings=self.planner_settings,
                    deadline=deadline, instance=self.instance, meta=meta, on_frozen=on_frozen,
                    engine=self.engine(),
                )  # fmt: skip
            except operations.ImageKept as exc:  # stopped, image kept here: push it
                self.pusher.add(exc.kept)
                raise
            outcome(result)
        return result

    async def _restore(self, image_url: str, job: str) -> operations.RestoreResult:
        return await operations.restore(
            image_url, settings=self.checkpoint_settings, image_settings=self.image_settings,
            job_name=job, engine=self.engine(),
        )  # fmt: skip

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
                "discover": self.settings.discover_jobs,
            },
            "jobs": [
                {**w.status(), "kept": self.pusher.status(w.name)} for w in self.workers.values()
            ],
            "parked": parking.parked_status(self.checkpoint_settings.state_dir),
            "notices": list(self.notices_seen),
            "sources": {n: vars(h) for n, h in (self.bus.health if self.bus else {}).items()},
        }
