"""Controller reporting: durable spool, retries, order, idempotence, restart re-sends."""

from __future__ import annotations

from pathlib import Path

from agent_helpers import TOKEN, EventSink, free_port, wait_until

from spotguard.agent.metrics import AgentMetrics
from spotguard.agent.reporter import Reporter
from spotguard.contracts import EventKind, make_event


async def test_events_are_retried_in_order_and_spool_empties(
    sink: EventSink, tmp_path: Path
) -> None:
    sink.fail_first = 3
    metrics = AgentMetrics()
    r = Reporter(sink.url, TOKEN, tmp_path / "outbox", metrics=metrics, max_backoff_s=0.2)
    await r.start()
    kinds = [EventKind.NOTICE, EventKind.FROZEN, EventKind.DURABLE, EventKind.EXITED]
    fields: list[dict[str, object]] = [
        {"notice": {"id": "n1", "kind": "preempt"}},
        {"mode": "exit"},
        {"image_url": "file:///x"},
        {},
    ]
    sent = [make_event(job="train", kind=k, **f) for k, f in zip(kinds, fields, strict=True)]
    for e in sent:
        r.emit(e)  # returns at once, never waits for the controller
    assert await r.flush(20)
    await r.aclose()
    assert [e["event_id"] for e in sink.events] == [e.event_id for e in sent]
    assert sink.kinds() == [k.value for k in kinds]
    assert sink.requests == len(kinds) + 3
    assert r.pending() == []
    assert b'spotguard_failures_total{step="report"} 3.0' in metrics.render()


async def test_restarted_reporter_resends_what_was_spooled(sink: EventSink, tmp_path: Path) -> None:
    spool = tmp_path / "outbox"
    down = Reporter(f"http://127.0.0.1:{free_port()}", TOKEN, spool, max_backoff_s=0.1)
    await down.start()
    first = make_event(job="train", kind=EventKind.DURABLE, image_url="file:///x")
    down.emit(first)
    assert not await down.flush(0.5)
    await down.aclose()  # the agent dies with the report undelivered
    assert len(down.pending()) == 1

    up = Reporter(sink.url, TOKEN, spool)
    await up.start()
    assert await up.flush(20)
    await up.aclose()
    assert [e["event_id"] for e in sink.events] == [first.event_id]
    assert sink.events[0]["image_url"] == "file:///x"


async def test_wrong_token_is_retried_not_dropped(sink: EventSink, tmp_path: Path) -> None:
    r = Reporter(sink.url, "wrong", tmp_path / "outbox", max_backoff_s=0.1)
    await r.start()
    r.emit(make_event(job="train", kind=EventKind.STARTED))
    await wait_until(lambda: sink.requests >= 2)
    assert len(r.pending()) == 1 and sink.events == []
    await r.aclose()


async def test_without_controller_nothing_is_spooled(tmp_path: Path) -> None:
    r = Reporter(None, None, tmp_path / "outbox")
    await r.start()
    r.emit(make_event(job="train", kind=EventKind.STARTED))
    assert await r.flush(0.1)
    assert not (tmp_path / "outbox").exists()
    await r.aclose()
