"""The agent's notice handling on its own (:class:`~spotguard.agent.dispatch.NoticeDispatcher`):
built with real collaborators — the default policy, real :class:`JobWorker` objects guarding a
real process, a real reporter sending to a real HTTP endpoint, the manual source on a real
notice bus, a ledger and the node's parks in a temporary state dir. The workers do not run
here: what a notice asks of a job is read from its pending requests."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import TOKEN, EventSink, wait_until

from spotguard.agent.dispatch import NoticeDispatcher
from spotguard.agent.ledger import Ledger
from spotguard.agent.metrics import AgentMetrics
from spotguard.agent.parking import NodeParks
from spotguard.agent.policy import Policy
from spotguard.agent.reporter import Reporter
from spotguard.agent.worker import JobWorker
from spotguard.contracts import Directive, Mode, Owner
from spotguard.facts import InstanceFacts
from spotguard.image import ImageSettings
from spotguard.notices.base import Cloud, Notice, NoticeKind
from spotguard.notices.bus import NoticeBus
from spotguard.notices.manual import ManualSource


@pytest.fixture
def process() -> Iterator[int]:
    """A real process for the workers to guard."""
    proc = subprocess.Popen(["sleep", "300"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@dataclass
class Node:
    dispatcher: NoticeDispatcher
    workers: dict[str, JobWorker]
    reporter: Reporter
    ledger: Ledger
    manual: ManualSource
    settled: list[str]

    def worker(self, name: str, pid: int) -> JobWorker:
        async def no_checkpoint(*_args: Any) -> Any:
            raise AssertionError("the workers do not run in these tests")

        w = JobWorker(
            name, pid, no_checkpoint, reporter=self.reporter, metrics=AgentMetrics(),
            instance={"provider": "local", "instance_id": "vm-here"},
        )  # fmt: skip
        self.workers[name] = w
        return w


@pytest.fixture
async def node(sink: EventSink, tmp_path: Path) -> AsyncIterator[Node]:
    metrics = AgentMetrics()
    reporter = Reporter(sink.url, TOKEN, tmp_path / "outbox", metrics=metrics)
    await reporter.start()
    workers: dict[str, JobWorker] = {}
    ledger = Ledger(tmp_path / "jobs")
    instance = InstanceFacts(provider="local", instance_id="vm-here")
    parks = NodeParks(
        tmp_path / "state", store=f"file://{tmp_path}/store", image=ImageSettings(),
        instance=instance, reporter=reporter, metrics=metrics,
    )  # fmt: skip
    tasks: set[asyncio.Task[Any]] = set()

    def spawn(coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        tasks.add(task)
        return task

    settled: list[str] = []
    manual = ManualSource()
    dispatcher = NoticeDispatcher(
        policy=Policy.default(), workers=workers, reporter=reporter, metrics=metrics,
        manual=manual, instance=instance, parks=parks, ledger=ledger, spawn=spawn,
        on_settled=lambda: settled.append("settled"), drain_deadline=120.0,
    )  # fmt: skip
    try:
        yield Node(dispatcher, workers, reporter, ledger, manual, settled)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await reporter.aclose()


def preempt(seconds: float = 120.0, nid: str = "n1") -> Notice:
    deadline = datetime.now(UTC) + timedelta(seconds=seconds)
    return Notice(nid, Cloud.AWS, NoticeKind.PREEMPT, deadline, "terminate")


async def test_a_notice_is_reported_and_queued_on_every_active_job_and_a_cancel_drops_it(
    node: Node, sink: EventSink, process: int
) -> None:
    train, other = node.worker("train", process), node.worker("other", process)
    assert other.stand_down("owned elsewhere")
    notice = preempt()
    node.dispatcher.handle(notice)
    await wait_until(lambda: bool(train.pending), 10)  # queued by the notice's own task
    assert list(train.pending) == ["n1"] and other.pending == {}
    assert train.pending["n1"].mode is Policy.default().decide(notice).action.mode
    assert node.dispatcher.seen[-1]["id"] == "n1" and "n1" in node.dispatcher.live
    assert await node.reporter.flush(10)
    [event] = [e for e in sink.events if e["kind"] == "notice"]
    assert event["job"] == "train" and event["notice"]["id"] == "n1"
    assert event["decision"] == train.pending["n1"].mode.value

    node.dispatcher.handle(notice.cancel())
    assert train.pending == {} and "n1" not in node.dispatcher.live
    await wait_until(lambda: bool(node.settled), 10)  # the notice's outcome is known


async def test_a_live_notice_reaches_a_job_protected_after_it_once(
    node: Node, process: int
) -> None:
    node.dispatcher.handle(preempt(nid="early"))  # no job protected yet
    node.dispatcher.handle(preempt(seconds=0.05, nid="gone"))
    await asyncio.sleep(0.1)  # "gone" is past its deadline now
    late = node.worker("late", process)
    node.dispatcher.replay(late)
    assert list(late.pending) == ["early"]
    assert "gone" not in node.dispatcher.live
    late.cancel("early")
    node.dispatcher.replay(late)  # it had the notice once: not again
    assert late.pending == {}


async def test_controller_answers_stand_a_job_down_or_drain_the_node_once(
    node: Node, process: int
) -> None:
    train = node.worker("train", process)
    bus = NoticeBus([node.manual])
    watching = asyncio.create_task(node.dispatcher.watch(bus))
    try:
        ask = Directive(job="train", state="protected", action="drain", reason="migrate to b")
        node.dispatcher.controller_says(ask)
        node.dispatcher.controller_says(ask)  # asked again while the drain is on its way
        await wait_until(lambda: bool(train.pending), 10)
        [(key, req)] = train.pending.items()
        assert key.startswith("manual-") and req.notice is not None
        assert req.notice.kind is NoticeKind.DRAIN and req.mode is Mode.EXIT
        assert req.notice.raw["reason"] == "controller: migrate to b"
        assert req.notice.raw["deadline_s"] == 120.0  # the agent's drain deadline
        assert len(node.manual.active()) == 1

        moved = Directive(
            job="train", state="protected", owner=Owner(instance_id="vm-there", epoch=3)
        )
        node.dispatcher.controller_says(moved)
        assert train.state == "stood_down" and "vm-there" in (train.stood_down or "")
        assert train.pending == {}  # its waiting drain is released
        record = node.ledger.get("train")
        assert record is not None and record.state == "stood_down"
        assert node.settled
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await bus.aclose()


async def test_an_answer_for_a_job_this_agent_owns_changes_nothing(
    node: Node, process: int
) -> None:
    train = node.worker("train", process)
    mine = Directive(job="train", state="protected", owner=Owner(instance_id="vm-here"))
    moving = Directive(job="train", state="launching", owner=Owner(instance_id="vm-new"))
    for answer in (mine, moving):
        node.dispatcher.controller_says(answer)
    assert train.state == "protecting" and train.pending == {} and not node.settled
