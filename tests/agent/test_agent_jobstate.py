"""The agent's one job-state vocabulary (:mod:`spotguard.agent.jobstate`): the worker moves
only along allowed transitions (an impossible one is a typed error and leaves the state as it
was), and the ledger writes and reads back every state it records as the same strings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spotguard.agent.jobstate import LEDGER_STATES, TRANSITIONS, JobState
from spotguard.agent.ledger import Ledger, LedgerRecord
from spotguard.agent.metrics import AgentMetrics
from spotguard.agent.reporter import Reporter
from spotguard.agent.worker import JobWorker
from spotguard.errors import JobError, JobStateError


def worker(tmp_path: Path) -> JobWorker:
    async def never(*_: Any) -> Any:
        raise AssertionError("no checkpoint in this test")

    metrics = AgentMetrics()
    reporter = Reporter(None, None, tmp_path / "outbox", metrics=metrics)
    return JobWorker("train", 1, never, reporter=reporter, metrics=metrics, instance={})


def test_the_wire_strings_stay_as_they_were() -> None:
    assert {s.value for s in JobState} == {
        "protecting", "checkpointing", "exiting", "exited", "finished", "pushing", "parked",
        "stood_down",
    }  # fmt: skip
    assert json.dumps({"state": JobState.STOOD_DOWN}) == '{"state": "stood_down"}'


def test_the_worker_refuses_an_impossible_transition(tmp_path: Path) -> None:
    w = worker(tmp_path)
    assert w.state is JobState.PROTECTING
    w.move(JobState.EXITED)
    with pytest.raises(JobStateError) as err:
        w.move(JobState.PROTECTING)  # an exited job is not protected again by this worker
    assert isinstance(err.value, JobError)
    assert "exited" in str(err.value) and "protecting" in str(err.value)
    assert w.state is JobState.EXITED


def test_the_worker_takes_each_allowed_transition(tmp_path: Path) -> None:
    for src, targets in TRANSITIONS.items():
        for dst in targets:
            w = worker(tmp_path)
            w.state = src
            w.move(dst)
            assert w.state is dst


def test_the_ledger_round_trips_every_state(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "jobs")
    for state in LEDGER_STATES:
        ledger.put("train", 42, state)
        rec = ledger.get("train")
        assert isinstance(rec, LedgerRecord)
        assert rec.state is state
        on_disk = json.loads((tmp_path / "jobs" / "train.json").read_text())
        assert on_disk["state"] == state.value


def test_the_ledger_refuses_a_state_it_never_records(tmp_path: Path) -> None:
    (tmp_path / "jobs").mkdir()
    path = tmp_path / "jobs" / "train.json"
    path.write_text(json.dumps({"job": "train", "pid": 42, "state": "checkpointing"}))
    assert Ledger(tmp_path / "jobs").get("train") is None  # unreadable: ignored, logged
