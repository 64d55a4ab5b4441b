"""How the agent handles a notice: count, report, decide, queue on every active job, push
the jobs parked on this node's tmpfs or disk to the store (:meth:`spotguard.agent.parking.
NodeParks.evacuate`: they would go with the node), and acknowledge it (Azure) once every job's
image for it is durable — or at once when the policy does nothing. A cancelled notice drops
what is still waiting. An operator's drain and the controller's "drain" answer become manual
notices and go the same way; an answer saying the job is owned elsewhere makes the agent stand
down for it (:mod:`~spotguard.agent.standdown`).

:class:`NoticeDispatcher` is an object the daemon holds; everything it works with is handed to
it when it is built (the policy, the jobs' workers, the reporter, the node's parks, ...).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Coroutine, Mapping
from datetime import UTC, datetime
from typing import Any

from spotguard.contracts import Directive, InstanceInfo, NoticeEvent, NoticeInfo
from spotguard.errors import NoticeError
from spotguard.facts import InstanceFacts
from spotguard.notices.base import Cloud, Notice
from spotguard.notices.bus import NoticeBus
from spotguard.notices.manual import ManualSource

from .jobstate import JobState
from .ledger import Ledger
from .metrics import AgentMetrics
from .parking import NodeParks
from .policy import Policy
from .reporter import Reporter
from .standdown import owned_elsewhere
from .worker import JobWorker, Request

log = logging.getLogger(__name__)

#: starts a supervised task of the agent: (coroutine, name) → task
Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any]"]


class NoticeDispatcher:
    """Notices (and controller answers) → checkpoint requests on the jobs' workers."""

    def __init__(
        self,
        *,
        policy: Policy,
        workers: Mapping[str, JobWorker],
        reporter: Reporter,
        metrics: AgentMetrics,
        manual: ManualSource,
        instance: InstanceFacts,
        parks: NodeParks,
        ledger: Ledger,
        spawn: Spawn,
        on_settled: Callable[[], None],
        drain_deadline: float,
    ) -> None:
        self.policy = policy
        self.workers = workers  # the daemon's: read here, never changed
        self.reporter = reporter
        self.metrics = metrics
        self.manual = manual
        self.instance = instance
        self.parks = parks
        self.ledger = ledger
        self._spawn = spawn
        self._on_settled = on_settled  # a notice's outcome is known, or a job stood down
        self.drain_deadline = drain_deadline
        self.bus: NoticeBus | None = None
        self.seen: list[dict[str, Any]] = []  # the last 50 notices (status)
        # notices that still ask for a checkpoint (by id) and the jobs they went to
        self.live: dict[str, tuple[Notice, set[str]]] = {}
        self._outcomes: dict[str, asyncio.Future[list[dict[str, Any]]]] = {}
        self._controller_drain = False

    async def watch(self, bus: NoticeBus) -> None:
        """Handle every notice of ``bus`` until cancelled (it also acknowledges them)."""
        self.bus = bus
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
        """Count, report, decide and queue one notice (or drop a cancelled one). A notice
        that asks for a checkpoint stays *live* until its deadline, so a job protected after
        it arrived still gets it (:meth:`replay`)."""
        self.metrics.notices.labels(notice.cloud.value, notice.kind.value).inc()
        self.seen.append(notice.to_json())
        del self.seen[:-50]
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
        mode = decision.action.mode  # None: nothing to checkpoint
        live = self.live
        jobs = [w for w in self.workers.values() if w.active]
        if notice.cancelled or mode is None:
            live.pop(notice.id, None)
        else:  # remembered with the jobs it went to: each job gets a notice once
            live[notice.id] = (notice, {w.name for w in jobs})
        for w in jobs:
            self.reporter.emit(
                NoticeEvent(
                    job=w.name,
                    instance=InstanceInfo.model_validate(self.instance.to_json()),
                    notice=NoticeInfo.model_validate(notice.to_json()),
                    decision=decision.action,
                    reason=decision.reason,
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
        kept = [] if mode is None else self.parks.kept()
        if mode is None or not (jobs or kept):
            self._spawn(self._acknowledge(notice), f"ack-{notice.id}")
            self._settle(notice.id, [{"job": w.name, "action": "none"} for w in jobs])
            return
        waiters: list[asyncio.Future[dict[str, Any]]] = [
            self._spawn(self.parks.evacuate(r.job), f"evacuate-{r.job}") for r in kept
        ]
        for w in jobs:
            req = Request(notice.id, mode, decision.start_at, decision.reason,
                          notice=notice)  # fmt: skip
            waiters.append(self._spawn(self._notice_checkpoint(w, req), f"notice-{w.name}"))
        self._spawn(self._after(notice, waiters), f"after-{notice.id}")

    async def _notice_checkpoint(self, worker: JobWorker, req: Request) -> dict[str, Any]:
        """The notice's checkpoint of one job, and its line in the results. A park of the
        job under way when the notice came (the checkpoint is refused, or the job's process
        goes away in it) is waited for within the notice's deadline and its image carried to
        the store (:meth:`~spotguard.agent.parking.NodeParks.after_park`); a park that left
        the job's process (failed, or suspended in place) has the job checkpointed again."""
        loop = asyncio.get_running_loop()
        result: dict[str, Any] = {}
        for attempt in range(2):
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            if attempt:
                req = dataclasses.replace(req, start_at=datetime.now(UTC))
            worker.submit(dataclasses.replace(req, waiters=[fut]))
            result = await fut
            notice = req.notice
            if notice is None:
                return result
            after = await self.parks.after_park(worker.name, result, notice.seconds_left)
            if after is not None:
                return after
        return result

    def replay(self, worker: JobWorker) -> None:
        """Queue on a newly protected job every live notice it has not had: one that came
        while this job was not protected — an agent restarted with a notice still posted, or
        a job that started after it. A job that had the notice (and was, say, restored by
        hand since) does not get it again. Notices past their deadline are dropped."""
        live = self.live
        for nid, (notice, applied) in list(live.items()):
            if notice.seconds_left() <= 0:
                del live[nid]
                continue
            if worker.name in applied or nid in worker.pending:
                continue  # this job had it already (e.g. restored by hand after it)
            applied.add(worker.name)
            decision = self.policy.decide(notice)
            mode = decision.action.mode
            if mode is None:  # live notices are those that asked for a checkpoint
                continue
            log.info(
                "notice applies to a job protected after it came",
                extra={"step": "notice", "notice": nid, "job": worker.name},
            )
            self.reporter.emit(
                NoticeEvent(
                    job=worker.name,
                    instance=InstanceInfo.model_validate(self.instance.to_json()),
                    notice=NoticeInfo.model_validate(notice.to_json()),
                    decision=decision.action,
                    reason=decision.reason,
                )
            )
            worker.submit(Request(nid, mode, decision.start_at, decision.reason, notice=notice))

    async def _after(self, notice: Notice, waiters: list[asyncio.Future[dict[str, Any]]]) -> None:
        results = list(await asyncio.gather(*waiters))
        if not any(r.get("cancelled") for r in results):
            await self._acknowledge(notice)
        self._settle(notice.id, results)
        self._on_settled()

    def _settle(self, notice_id: str, results: list[dict[str, Any]]) -> None:
        """The outcome of notice ``notice_id`` is known. An operator drain ends with it: it
        asked to vacate the node *now*, so it is no longer live — a job started (or restored
        by hand) afterwards is not stopped by it, whether the drain wrote an image or not.
        A cloud's notice stays live until its deadline (the VM really goes away)."""
        live = self.live.get(notice_id)
        if live is not None and live[0].cloud is Cloud.MANUAL:
            del self.live[notice_id]
            self.manual.settle(notice_id)
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

    def controller_says(self, answer: Directive) -> None:
        """The controller answers each event (and directive poll) with what it wants next:
        an answer saying the job is owned elsewhere makes this agent stand down for it
        (:mod:`~spotguard.agent.standdown`); ``drain`` (a migration waiting for a fresh
        image) starts an operator-style drain once."""
        why = owned_elsewhere(answer, self.instance.instance_id)
        if why is not None:
            self._stand_down(answer.job, why)
            return
        if answer.action != "drain" or self._controller_drain:
            return
        if not any(w.active for w in self.workers.values()):
            return
        self._controller_drain = True
        log.info(
            "controller asks for a drain",
            extra={"step": "drain", "job": answer.job, "reason": answer.reason},
        )
        reason = "controller: " + (answer.reason or "migrate")
        self._spawn(self.drain(reason, wait=False, deadline_s=None), "controller-drain")

    def _stand_down(self, job: str, reason: str) -> None:
        """Stop acting for ``job`` (owned elsewhere); the ledger keeps it for a restart."""
        worker = self.workers.get(job)
        if worker is not None and worker.stand_down(reason):
            self.ledger.put(job, worker.pid, JobState.STOOD_DOWN)
            self.metrics.failures.labels("stand_down").inc()
            self._on_settled()

    async def drain(self, reason: str, *, wait: bool, deadline_s: float | None) -> dict[str, Any]:
        """Operator drain of every protected job: a manual notice through the bus (so it is
        deduplicated, logged and decided like any other); with ``wait``, the outcomes."""
        notice = await self.manual.drain(reason, deadline_s or self.drain_deadline)
        fut: asyncio.Future[list[dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self._outcomes[notice.id] = fut
        answer: dict[str, Any] = {"notice": notice.to_json()}
        if wait:
            answer["results"] = await fut
            self._outcomes.pop(notice.id, None)
        return answer
