"""The job state machine as a table: every (state, kind) has a handler, each pair's outcome is
pinned here, and the same report from a sender that no longer owns the job changes nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from spotguard.contracts import AnyEvent, EventKind, NoticeInfo, Owner, WireError, make_event
from spotguard.controller.machine import HANDLERS, Options, on_event, settle_early_report
from spotguard.controller.state import Change, JobRecord, JobState
from spotguard.errors import DecryptionError, ImageCorrupt, MismatchError, StoreUnavailable

OLD = {"provider": "aws", "instance_id": "i-old"}
NEW = {"provider": "aws", "instance_id": "i-new"}
IMAGE = "file:///s/train/images/20260101T000000000000Z-aaaaaa"
PARKED_IMAGE = "file:///s/train/images/20260102T000000000000Z-bbbbbb"
P, I, C, L, R, F, D, W = (  # noqa: E741 - the states' initials (W: waiting, parked)
    JobState.PROTECTED,
    JobState.INTERRUPTING,
    JobState.CHECKPOINTED,
    JobState.LAUNCHING,
    JobState.RESTORING,
    JobState.FAILED,
    JobState.FINISHED,
    JobState.PARKED,
)
K = EventKind

#: The state each (state, kind) leads to when the job's owner reports it.
EXPECTED: dict[JobState, dict[EventKind, JobState]] = {
    P: {K.STARTED: P, K.NOTICE: I, K.FROZEN: P, K.DURABLE: P, K.CHECKPOINT_FAILED: P,
        K.EXITED: L, K.READY_TO_RELAUNCH: L, K.RESTORING: P, K.RESTORED: P,
        K.RESTORE_FAILED: P, K.JOB_FINISHED: D, K.PARKED: W},
    I: {K.STARTED: P, K.NOTICE: I, K.FROZEN: I, K.DURABLE: C, K.CHECKPOINT_FAILED: I,
        K.EXITED: L, K.READY_TO_RELAUNCH: L, K.RESTORING: I, K.RESTORED: I,
        K.RESTORE_FAILED: I, K.JOB_FINISHED: D, K.PARKED: W},
    C: {K.STARTED: P, K.NOTICE: C, K.FROZEN: C, K.DURABLE: C, K.CHECKPOINT_FAILED: C,
        K.EXITED: L, K.READY_TO_RELAUNCH: L, K.RESTORING: C, K.RESTORED: C,
        K.RESTORE_FAILED: C, K.JOB_FINISHED: D, K.PARKED: W},
    L: {K.STARTED: L, K.NOTICE: L, K.FROZEN: L, K.DURABLE: L, K.CHECKPOINT_FAILED: L,
        K.EXITED: L, K.READY_TO_RELAUNCH: L, K.RESTORING: L, K.RESTORED: L,
        K.RESTORE_FAILED: L, K.JOB_FINISHED: D, K.PARKED: L},
    R: {K.STARTED: P, K.NOTICE: R, K.FROZEN: R, K.DURABLE: R, K.CHECKPOINT_FAILED: R,
        K.EXITED: L, K.READY_TO_RELAUNCH: L, K.RESTORING: R, K.RESTORED: P,
        K.RESTORE_FAILED: L, K.JOB_FINISHED: D, K.PARKED: R},
    # parked to a store: never relaunched by an event; its owner unparking it by hand is back
    W: {k: W for k in EventKind} | {K.STARTED: P, K.JOB_FINISHED: D},
    F: {k: F for k in EventKind} | {K.STARTED: P},
    D: {k: D for k in EventKind} | {K.STARTED: P},
}  # fmt: skip


def record(state: JobState) -> JobRecord:
    """A job in ``state`` as the controller would hold it (moving states: the new instance
    i-new pending under epoch 1; the others: i-old owning it under epoch 0)."""
    rec = JobRecord(name="train", state=state, instance=dict(OLD), image_url=IMAGE)
    rec.data.owner = Owner(instance_id="i-old", epoch=0)
    if state is I:
        rec.data.notice = NoticeInfo(id="n", kind="preempt")
    if state in (L, R):
        rec.data.owner = Owner(instance_id="i-new" if state is R else None, epoch=1)
        rec.data.epochs = 1
    if state is R:
        rec.pending = {**NEW, "state": "running", "market": "spot"}
    if state is W:
        rec.data.parked_image = IMAGE
    return rec


def event(kind: EventKind, instance: dict[str, Any], epoch: int, **kw: Any) -> AnyEvent:
    deadline = (datetime.now(UTC) + timedelta(seconds=120)).isoformat()
    fields: dict[EventKind, dict[str, Any]] = {
        K.NOTICE: {"notice": {"id": "n2", "kind": "preempt", "deadline": deadline}},
        K.FROZEN: {"mode": "exit"},
        K.DURABLE: {"image_url": IMAGE, "image_bytes": 10},
        K.CHECKPOINT_FAILED: {"error": WireError.of(StoreUnavailable("down"))},
        K.EXITED: {"image_url": IMAGE},
        K.READY_TO_RELAUNCH: {"image_url": IMAGE},
        K.RESTORING: {"image_url": IMAGE},
        K.RESTORED: {"image_url": IMAGE},
        K.RESTORE_FAILED: {"image_url": IMAGE, "error": WireError.of(StoreUnavailable("x"))},
        K.PARKED: {"image_url": PARKED_IMAGE, "image_bytes": 10, "reason": "idle for 3600 s"},
    }
    return make_event(
        kind, job="train", instance=instance, epoch=epoch, **(fields.get(kind, {}) | kw)
    )


PAIRS = [(st, kind) for st in JobState for kind in EventKind]


def test_every_state_and_kind_has_a_handler() -> None:
    assert set(HANDLERS) == set(PAIRS)


@pytest.mark.parametrize(("state", "kind"), PAIRS, ids=[f"{s.value}-{k.value}" for s, k in PAIRS])
def test_each_pair_from_the_owner(state: JobState, kind: EventKind) -> None:
    rec = record(state)
    sender, epoch = (NEW, 1) if state in (L, R) else (OLD, 0)
    change = on_event(rec, event(kind, sender, epoch), Options())
    assert change is not None
    assert change.stale is None
    assert change.record.state is EXPECTED[state][kind], change.reason
    if change.record.state is L and state is not L:
        assert change.record.data.owner == Owner(instance_id=None, epoch=epoch + 1)


@pytest.mark.parametrize(("state", "kind"), PAIRS, ids=[f"{s.value}-{k.value}" for s, k in PAIRS])
def test_each_pair_from_a_stale_epoch_is_recorded_and_ignored(
    state: JobState, kind: EventKind
) -> None:
    rec = record(state)
    before = rec.copy()
    stale_epoch = 5 if state not in (L, R) else 0
    change = on_event(rec, event(kind, OLD, stale_epoch), Options())
    assert change is not None and change.note
    assert change.stale is not None and "epoch" in change.stale
    assert change.record.state is before.state
    assert change.record.data.owner == before.data.owner
    assert change.record.data.terminate == before.data.terminate


def test_the_old_vms_job_finished_without_epoch_is_fenced_by_instance() -> None:
    """A fleet-token agent names no epoch: its instance id tells it is not the owner."""
    rec = record(P)
    rec.instance = dict(NEW)
    rec.data.owner = Owner(instance_id="i-new", epoch=1)
    rec.data.launched = {**NEW, "state": "running", "market": "spot"}
    change = on_event(rec, make_event(K.JOB_FINISHED, job="train", instance=OLD), Options())
    assert change is not None and change.stale is not None
    assert change.record.state is P
    assert change.record.data.terminate == []  # the new VM is not terminated


@pytest.mark.parametrize(
    ("error", "state", "older"),
    [
        (StoreUnavailable("store down"), L, False),  # retryable: another VM, the same image
        (ImageCorrupt("chunk ab12 failed verification", chunk="ab12"), L, True),
        (MismatchError("GPU model", "h100", "a10g"), F, False),  # no other VM will do
        (DecryptionError("no key"), F, False),  # the host's key: an older image needs it too
    ],
)
def test_restore_failed_is_decided_by_retryable_and_image_fault(
    error: Exception, state: JobState, older: bool
) -> None:
    rec = record(R)
    ev = event(K.RESTORE_FAILED, NEW, 1, error=WireError.of(error))
    change = on_event(rec, ev, Options())
    assert change is not None
    assert change.record.state is state, change.reason
    assert change.record.data.older_image is older
    assert (IMAGE in change.record.data.bad_images) is older
    assert change.record.pending is None
    assert change.record.data.terminate[-1]["instance_id"] == "i-new"
    if state is L:
        assert change.record.data.owner.epoch == 2  # the failed VM's agent is fenced off


def test_parked_holds_the_image_and_drops_the_notice_being_handled() -> None:
    """Parked while a notice is handled: the job's state is the parked image and no VM holds
    the job any more, so the notice's deadline can no longer relaunch it."""
    rec = record(I)
    rec.deadline = 123.0
    change = on_event(rec, event(K.PARKED, OLD, 0), Options())
    assert change is not None
    out = change.record
    assert out.state is W and out.image_url == PARKED_IMAGE
    assert (out.deadline, out.data.notice, out.data.parked_image) == (None, None, PARKED_IMAGE)
    assert out.data.parked_reason == "idle for 3600 s"
    assert change.reason == f"parked to {PARKED_IMAGE} on i-old (idle for 3600 s)"
    assert change.image == (PARKED_IMAGE, 10)  # listed with the job's images


def test_started_from_the_owner_of_a_parked_job_protects_it_again() -> None:
    """Unparked by hand on its node: the agent there protects it again and says so."""
    change = on_event(record(W), event(K.STARTED, OLD, 0), Options())
    assert change is not None
    assert change.record.state is P
    assert change.record.data.parked_image is None
    assert change.record.data.owner == Owner(instance_id="i-old", epoch=0)


def test_a_second_park_of_a_parked_job_moves_to_its_new_image() -> None:
    rec = record(W)
    change = on_event(rec, event(K.PARKED, OLD, 0), Options())
    assert change is not None and change.note
    assert change.record.data.parked_image == PARKED_IMAGE


@pytest.mark.parametrize("kind", [K.RESTORED, K.RESTORE_FAILED])
def test_a_report_of_the_round_before_its_launch_is_recorded_is_kept_then_applied(
    kind: EventKind,
) -> None:
    rec = record(L)
    change = on_event(rec, event(kind, NEW, 1), Options())
    assert change is not None and change.note and change.record.state is L
    assert change.record.data.early_report is not None
    assert change.record.data.early_report.kind is kind
    # the launch is recorded: LAUNCHING → RESTORING, then the kept report applies
    rec = change.record
    rec.state, rec.pending = R, {**NEW, "state": "running", "market": "spot"}
    settled = settle_early_report(Change(rec, "launched i-new", {}))
    assert settled.record.data.early_report is None
    assert settled.record.state is (P if kind is K.RESTORED else L)
    assert settled.reason.startswith("launched i-new; ")
    if kind is K.RESTORED:
        assert settled.record.pending is None and settled.record.data.failed_rounds == 0
    else:  # retryable: a new round, the failed VM queued for termination
        assert settled.record.data.owner.epoch == 2
        assert [t["instance_id"] for t in settled.record.data.terminate] == ["i-new"]


def test_a_report_while_launching_without_the_rounds_epoch_is_only_recorded() -> None:
    rec = record(L)
    fleet = on_event(rec, event(K.RESTORED, NEW, 1).model_copy(update={"epoch": None}), Options())
    assert fleet is not None and fleet.record.data.early_report is None
    # kept from an earlier epoch and the round moved on: not applied to the new round
    rec = record(L)
    rec.data.early_report = event(K.RESTORED, NEW, 1)  # type: ignore[assignment]
    rec.data.owner = Owner(instance_id=None, epoch=2)
    rec.state = R
    settled = settle_early_report(Change(rec, "launched i-newer", {}))
    assert settled.record.state is R and settled.record.data.early_report is None
