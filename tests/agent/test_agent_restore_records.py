"""The boot-restore progress records (``{state_dir}/agent/assignments/<key>.json``): typed
(:class:`RestoreProgress`), and the file an older agent wrote is the file this one reads
and writes — an agent upgraded between a restore and its record must not restore twice."""

from __future__ import annotations

import json
from pathlib import Path

from spotguard.agent.restore import RestoreProgress, RestoreRecords, RestoreStep
from spotguard.contracts import Assignment

T = 1764100000.5  # when an intent was recorded
A = Assignment(job="train", image_url="file:///s/train/images/i1", store="file:///s", attempt=2)


def test_each_step_writes_the_keys_it_always_wrote_and_reads_back_typed(tmp_path: Path) -> None:
    book = RestoreRecords(tmp_path / "assignments")
    base = {"job": "train", "image_url": A.image_url, "attempt": 2}
    steps = [  # each step's progress, and the keys it adds to the assignment's
        (RestoreProgress.of(A, RestoreStep.RESTORING, started=T), {"started": T}),
        (RestoreProgress.of(A, RestoreStep.RESTORED, pid=4242), {"pid": 4242}),
        (RestoreProgress.of(A, RestoreStep.FAILED, error="E: x"), {"error": "E: x"}),
    ]  # fmt: skip
    for progress, extra in steps:
        book.save(progress)
        written = json.loads(book.path(A).read_text())
        assert written == {**base, "state": progress.state.value, **extra}
        assert list(written) == [*base, "state", *extra]  # the order the dict form had
        back = book.load(A)
        assert back == progress and back is not None and back.state is progress.state
    assert [p.name for p in book.folder.iterdir()] == [book.path(A).name]  # one file, replaced


def test_a_record_an_older_agent_wrote_is_read_and_a_torn_one_is_none(tmp_path: Path) -> None:
    book = RestoreRecords(tmp_path / "assignments")
    book.folder.mkdir()
    old = {"job": "train", "image_url": A.image_url, "attempt": 2, "state": "restored", "pid": 7}
    book.path(A).write_text(json.dumps(old, indent=2) + "\n")
    rec = book.load(A)
    assert rec is not None and rec.state is RestoreStep.RESTORED and rec.pid == 7
    book.path(A).write_text('{"job": "train", "state": "rest')  # a write cut short
    assert book.load(A) is None  # a help, not a condition: the restore runs as if first
    book.path(A).write_text(json.dumps({**old, "state": "halfway"}))
    assert book.load(A) is None
