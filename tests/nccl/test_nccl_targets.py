"""ncclctl.targets: the drain targets that bring every rank level with its peers (collectives
up to the one furthest ahead, sends and receives up to what each peer posted)."""

from __future__ import annotations

from pathlib import Path

from spotguard.checkpoint.ncclctl import Comm, Member, targets


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
