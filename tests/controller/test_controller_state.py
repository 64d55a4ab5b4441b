"""Durable state: every transition recorded, event ids deduplicated, a bad file refused
(and left untouched), and a restarted controller resuming a launch without a second VM."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.contracts import EventKind, NoticeInfo, make_event
from spotguard.controller.core import Controller
from spotguard.controller.settings import ControllerSettings
from spotguard.controller.state import SCHEMA_VERSION, Change, JobRecord, JobState, StateDB
from spotguard.errors import StateError
from spotguard.image.settings import ImageSettings
from spotguard.providers.base import LaunchSpec
from spotguard.providers.local import LocalProvider, LocalSettings

STANDIN = str(Path(__file__).with_name("sg_standin_agent.py"))


async def test_changes_are_atomic_recorded_and_survive_reopen(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    db = await StateDB.open(path)

    def create(rec: JobRecord | None) -> Change:
        assert rec is None
        return Change(JobRecord(name="j", state=JobState.PROTECTED), "first report")

    def interrupt(rec: JobRecord | None) -> Change:
        assert rec is not None
        rec.state = JobState.INTERRUPTING
        rec.data.notice = NoticeInfo(id="n")
        return Change(rec, "notice", {"k": 1})

    await db.change("j", create, event=("e1", "started", "{}"))
    _, applied = await db.change("j", create, event=("e1", "started", "{}"))
    assert applied is False  # same event id: a no-op, create() never ran twice
    await db.change("j", interrupt)
    await db.close()

    db = await StateDB.open(path)
    rec = await db.get("j")
    assert rec is not None
    assert rec.state is JobState.INTERRUPTING
    assert rec.data.notice == NoticeInfo(id="n")
    hist = await db.history("j")
    assert [(h["from"], h["to"], h["reason"]) for h in hist] == [
        (None, "protected", "first report"),
        ("protected", "interrupting", "notice"),
    ]
    assert hist[1]["detail"] == {"k": 1}
    await db.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()


async def test_a_failing_change_writes_nothing(tmp_path: Path) -> None:
    db = await StateDB.open(tmp_path / "s.db")

    def boom(rec: JobRecord | None) -> Change:
        raise ValueError("bug in a change function")

    with pytest.raises(ValueError, match="bug"):
        await db.change("j", boom, event=("e9", "notice", "{}"))
    assert await db.get("j") is None
    # the event id was not consumed: a retry is applied
    _, applied = await db.change("j", lambda r: None, event=("e9", "notice", "{}"))
    assert applied is True
    await db.close()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"this is not a database at all" * 100, "not a readable spotguard state database"),
        (None, "SQLite database of something else"),
    ],
)
async def test_corrupt_or_foreign_state_file_is_a_clear_error_and_left_untouched(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "bad.db"
    if content is None:
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE photos (id INTEGER)")
        conn.commit()
        conn.close()
    else:
        path.write_bytes(content)
    before = path.read_bytes()
    with pytest.raises(StateError, match=message):
        await StateDB.open(path)
    assert path.read_bytes() == before


def test_controller_command_on_a_corrupt_state_file_prints_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.db"
    path.write_bytes(b"\x00garbage" * 512)
    exe = Path(sys.executable).with_name("spotguard")
    out = subprocess.run(
        [str(exe), "controller", "--state", str(path), "--listen", "127.0.0.1:0"],
        env={**os.environ, "SPOTGUARD_CONTROLLER_TOKEN": "t"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2  # refused for good: systemd does not restart it (exit 2)
    assert "Traceback" not in out.stderr
    assert "spotguard: error: state file" in out.stderr
    assert "left as is" in out.stderr


def test_controller_without_token_refuses_to_start(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("spotguard")
    out = subprocess.run(
        [str(exe), "controller", "--state", str(tmp_path / "s.db")],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert out.returncode == 2
    assert "needs a token" in out.stderr


async def test_restart_mid_launch_adopts_the_vm_of_the_persisted_round(tmp_path: Path) -> None:
    """A controller that died after the VM started but before recording it finds that VM by
    its round token instead of launching another."""
    settings, local, db, first, _image = await _job_to_relaunch(tmp_path)
    rec = await db.get("j")
    assert rec is not None
    assert rec.state is JobState.LAUNCHING
    # What the dead controller got done: round token persisted, VM started, nothing recorded.
    await db.change("j", lambda r: Change(r, "round 1", note=True) if r and _begin(r) else None)
    rec = await db.get("j")
    assert rec is not None
    assert rec.launch_token == "deadbeef"
    offer = (await local.offers(LaunchSpec.from_json(rec.spec)))[0]
    vm = await local.launch(offer, first.reconciler.assignment(rec, {}), client_token="deadbeef-0")

    second = Controller(settings, db, local, image=ImageSettings.model_validate({}))
    await second.start()
    try:
        for _ in range(200):
            rec = await db.get("j")
            assert rec is not None
            if rec.state is JobState.RESTORING:
                break
            await asyncio.sleep(0.02)
        assert rec.state is JobState.RESTORING
        assert rec.pending is not None
        assert rec.pending["instance_id"] == vm.instance_id
        assert rec.restarts == 1
        assert len(list((tmp_path / "local" / "vms").iterdir())) == 1
    finally:
        await second.stop()
        await local.terminate(vm)
        await db.close()


def _begin(r: JobRecord) -> bool:
    r.launch_token = "deadbeef"
    r.restarts = 1
    return True


@pytest.mark.parametrize("kind", ["restored", "restore_failed"])
async def test_a_report_of_the_round_arriving_before_its_launch_is_recorded_is_kept(
    tmp_path: Path, kind: str
) -> None:
    """The new VM's agent can report its restore (or its failure) before the controller has
    recorded the launch: the controller died between the provider's launch and recording it,
    and the report reaches the restarted one before it adopts the VM. The report (of the
    current epoch) is answered 200, so the agent never sends it again: it must not be lost —
    a lost RESTORED leaves a running job in RESTORING until its restore times out, and the
    controller then terminates the VM it runs on."""
    settings, local, db, first, image = await _job_to_relaunch(tmp_path)
    await db.change("j", lambda r: Change(r, "round 1", note=True) if r and _begin(r) else None)
    rec = await db.get("j")
    assert rec is not None and rec.state is JobState.LAUNCHING
    epoch = rec.data.owner.epoch
    offer = (await local.offers(LaunchSpec.from_json(rec.spec)))[0]
    vm = await local.launch(offer, first.reconciler.assignment(rec, {}), client_token="deadbeef-0")

    second = Controller(settings, db, local, image=ImageSettings.model_validate({}))
    extra: dict[str, object] = {}
    if kind == "restore_failed":
        extra["error"] = {"code": "checkpoint", "message": "criu failed", "retryable": True}
    early = make_event(
        job="j",
        kind=kind,
        epoch=epoch,
        image_url=image,
        instance={"instance_id": "i-new-vm"},
        **extra,
    )
    answer = await second.handle_event(early)
    assert answer.record.state is JobState.LAUNCHING  # kept, not applied yet
    await second.start()
    try:
        want = JobState.PROTECTED if kind == "restored" else JobState.LAUNCHING
        for _ in range(250):
            rec = await db.get("j")
            assert rec is not None
            if rec.state is want and rec.pending is None and rec.launch_token != "deadbeef":
                break
            await asyncio.sleep(0.02)
        assert rec.state is want, (rec.state, rec.reason)
        assert rec.pending is None
        assert rec.data.early_report is None
        if kind == "restored":
            assert rec.data.owner.epoch == epoch
            assert rec.data.failed_rounds == 0
            assert [p for p in (tmp_path / "local" / "vms").iterdir()]  # the VM still runs
            assert vm.instance_id not in [t["instance_id"] for t in rec.data.terminate]
        else:  # the failed VM is terminated and a new round owns the job
            assert rec.data.owner.epoch > epoch
        hist = [h["reason"] for h in await db.history("j")]
        assert any("before its launch was recorded" in h for h in hist), hist
    finally:
        await second.stop()
        await local.terminate(vm)
        await db.close()


async def _job_to_relaunch(
    tmp_path: Path,
) -> tuple[ControllerSettings, LocalProvider, StateDB, Controller, str]:
    """A controller (and its local provider and state) holding job ``j`` that exited with an
    image: LAUNCHING, its first round about to start."""
    settings = ControllerSettings(
        listen="127.0.0.1:0",
        state=tmp_path / "s.db",
        controller_token="t",
        default_store=f"file://{tmp_path}/store",
        tick_s=0.05,
    )
    local = LocalProvider(
        LocalSettings(
            local_root=tmp_path / "local",
            local_agent_command=[sys.executable, "-c", "import time; time.sleep(60)"],
            local_gpus=False,
        )
    )
    db = await StateDB.open(settings.state)
    first = Controller(settings, db, local, image=ImageSettings.model_validate({}))
    image = f"file://{tmp_path}/store/j/images/x"
    await first.handle_event(make_event(job="j", kind=EventKind.STARTED))
    await first.handle_event(make_event(job="j", kind=EventKind.EXITED, image_url=image))
    return settings, local, db, first, image
