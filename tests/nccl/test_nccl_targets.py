"""ncclctl.targets: the drain targets that bring every rank level with its peers (collectives
up to the one furthest ahead, sends and receives up to what each peer posted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotguard.checkpoint.ncclctl import Comm, Member, targets
from spotguard.checkpoint.ncclgroup import check, connected, covered
from spotguard.errors import NcclError
from spotguard.groupwire import CommReport, MemberReport, RoundEntry


def _member(pid: int, *comms: Comm, inflight: int = 0) -> Member:
    return Member(pid, Path(f"/nonexistent/{pid}.sock"), "closed", inflight, 0, comms)


def test_targets_bring_behind_ranks_level_per_collective_count_and_per_peer() -> None:
    # communicator "tp" of 3 ranks: collectives issued 5, 7, 6; rank 0 sent 3 messages to
    # rank 1, which posted 2 receives from it; rank 1 posted 4 receives from rank 2, which
    # sent 1; rank 2 sent 2 to rank 0, which posted 2 receives (level). Communicator "dp"
    # of 2 ranks is level. Each process numbers its communicators its own way (the id).
    r0 = _member(
        100,
        Comm(3, "tp", 0, 3, 0, ops=5, send={1: 3}, recv={2: 2}),
        Comm(4, "dp", 0, 2, 0, ops=9),
    )
    r1 = _member(
        101,
        Comm(1, "tp", 1, 3, 1, ops=7, recv={0: 2, 2: 4}),
        Comm(2, "dp", 1, 2, 1, ops=9),
    )
    r2 = _member(102, Comm(8, "tp", 2, 3, 2, ops=6, send={0: 2, 1: 1}))
    got = targets([r0, r1, r2])
    assert {pid: sorted(t) for pid, t in got.items()} == {
        100: ["c3=7"],
        101: ["r1.0=3"],
        102: ["c8=7", "s8.1=4"],
    }


def test_targets_are_empty_when_every_rank_is_level() -> None:
    a = _member(1, Comm(0, "w", 0, 2, 0, ops=4, send={1: 2}, recv={1: 1}))
    b = _member(2, Comm(5, "w", 1, 2, 1, ops=4, send={0: 1}, recv={0: 2}))
    assert targets([a, b]) == {1: [], 2: []}
    # a rank alone in its communicator owes nobody anything
    assert targets([_member(3, Comm(0, "solo", 0, 1, 0, ops=11))]) == {3: []}


def _entry(job: str, *comms: tuple[str, int, int], abort: str | None = None) -> RoundEntry:
    """A round entry of ``job``: one member holding (key, rank, nranks) communicators."""
    reports = [CommReport(id=n, key=k, rank=r, nranks=size, dev=0, ops=0)
               for n, (k, r, size) in enumerate(comms)]  # fmt: skip
    return RoundEntry(job=job, members=[MemberReport(pid=1, state="closed", comms=reports)],
                      abort=abort)  # fmt: skip


def test_a_round_is_complete_once_every_rank_connected_to_the_job_is_there() -> None:
    """Agents decide on the jobs connected to theirs by communicators, transitively; an
    unrelated job of the same group's name changes nothing; an abort completes a round."""
    a = _entry("a", ("w", 0, 3), ("ab", 0, 2))
    b = _entry("b", ("w", 1, 3), ("ab", 1, 2), ("bc", 0, 2))
    c = _entry("c", ("w", 2, 3), ("bc", 1, 2))
    stranger = _entry("z", ("other", 0, 2))
    assert not covered([a], "a")
    assert not covered([a, b], "a")  # w's rank 2 and bc's rank 1 are missing
    assert covered([a, b, c], "a") and covered([c, b, a, stranger], "c")
    assert [e.job for e in connected([a, b, c, stranger], "a")] == ["a", "b", "c"]
    assert connected([a, stranger], "z") == [stranger]
    assert covered([a, _entry("b", abort="gave up")], "a")
    assert not covered([b, c], "a")  # the asking job's own entry is not there yet


def test_a_round_where_two_jobs_claim_one_rank_is_given_up() -> None:
    """A confused agent, or a caller that is not a member, cannot slip a rank in: two
    reports of one rank, or two sizes of one communicator, end the round in one line."""
    a = _entry("a", ("w", 0, 2))
    assert check([a, _entry("b", ("w", 1, 2))], "a") is None
    with pytest.raises(NcclError, match=r"job a pid 1 and job x pid 1 both report rank 0"):
        check([a, _entry("x", ("w", 0, 2))], "a")
    with pytest.raises(NcclError, match=r"with 3 ranks, others with 2"):
        check([a, _entry("x", ("w", 1, 3))], "a")
