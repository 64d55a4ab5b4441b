"""A job's ``reason`` (``spotguard jobs list``, webhooks) describes the state the job is in
now: once the job moves on, the reason of an earlier state (a notice, a failed launch round,
a park) is replaced, in the job list and in the notification its move sends."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any

from controller_helpers import VM1, Api, Factory

from spotguard.contracts import EventKind
from spotguard.controller.state import JobRecord
from spotguard.notify import Notification, from_transition


async def listed(api: Api, job: str) -> dict[str, Any]:
    """The job as ``GET /v1/jobs`` (``spotguard jobs list --json``) shows it."""
    rows = [j for j in (await api.get("/v1/jobs"))["jobs"] if j["job"] == job]
    assert len(rows) == 1, rows
    row: dict[str, Any] = rows[0]
    return row


async def test_reason_follows_the_job_through_notice_relaunch_restore_and_park(
    api_factory: Factory, tmp_path: Path
) -> None:
    marker = tmp_path / "lost-first"  # the first relaunched VM dies: a failed launch round
    api, srv, _ = await api_factory(env={"STANDIN_LOSE_FIRST": str(marker)}, liveness_s=0.1)
    sent: list[Notification] = []

    def hook(before: StrEnum | None, rec: JobRecord) -> None:  # what the notifier is given
        n = from_transition(before, rec)
        if n is not None:
            sent.append(n)

    srv.db.on_transition = hook
    job = "reasons"
    await api.event(job, EventKind.STARTED, instance=VM1)
    deadline = (datetime.now(UTC) + timedelta(seconds=120)).isoformat()
    notice = {"id": "n1", "cloud": "aws", "kind": "preempt", "deadline": deadline}
    await api.event(job, EventKind.NOTICE, instance=VM1, notice=notice)
    row = await listed(api, job)
    assert row["state"] == "interrupting"
    assert row["reason"] == "preempt notice on vm-first"

    image = f"file://{tmp_path}/store/{job}/images/20261122T000000000000Z-abc123"
    await api.event(job, EventKind.DURABLE, instance=VM1, image_url=image, image_bytes=10)
    assert (await listed(api, job))["reason"] == f"image {image} is durable"
    await api.event(job, EventKind.EXITED, instance=VM1, image_url=image)
    await api.wait_state(job, "protected")
    lost = marker.read_text()
    view = await api.get(f"/v1/jobs/{job}")
    assert any(f"instance {lost} is terminated" in h["reason"] for h in view["history"])

    vm = view["instance"]["instance_id"]
    row = await listed(api, job)
    assert row["state"] == "protected"
    assert row["reason"] == f"job restored and running on {vm}"
    restored = [n for n in sent if n.event.value == "restored"]
    assert [n.reason for n in restored] == [f"job restored and running on {vm}"]
    assert [n.event.value for n in sent] == ["relaunched", "relaunched", "restored"]
    assert (sent[1].reason or "").startswith(f"launched {vm} ")  # the second round's own

    where = {"provider": "local", "instance_id": vm}
    await api.event(job, EventKind.PARKED, instance=where, image_url=image, reason="idle")
    row = await listed(api, job)
    assert (row["state"], row["reason"]) == ("parked", f"parked to {image} on {vm} (idle)")
    await api.event(job, EventKind.STARTED, instance=where)  # unparked by hand on the node
    row = await listed(api, job)
    assert (row["state"], row["reason"]) == ("protected", f"agent protects the job on {vm}")
