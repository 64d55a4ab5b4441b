"""The controller as the rendezvous of NCCL jobs spanning VMs (:mod:`spotguard.groupwire`,
:mod:`spotguard.controller.rendezvous`), against a real controller over HTTP through the one
client: freeze generations (open, join, watch), rounds (one entry per job, long polls), who
may act for which job, and the bounds that keep a VM token from growing the controller."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from controller_helpers import TOKEN, Api, Factory, local, settings

from spotguard.controller import rendezvous, routes
from spotguard.controller.client import ControllerClient
from spotguard.controller.server import ControllerServer
from spotguard.controller.tokens import TokenKeys
from spotguard.errors import AuthError, ControllerRefused, EventTooLarge
from spotguard.groupwire import FreezeRequest, MemberReport, RoundEntry
from spotguard.image.settings import ImageSettings


def vm(url: str, job: str) -> ControllerClient:
    """A client with the VM token of ``job``'s owner at epoch 0."""
    return ControllerClient(url, TokenKeys(TOKEN).issue(job, 0))


def entry(job: str, pid: int = 1, **kw: Any) -> RoundEntry:
    return RoundEntry(job=job, members=[MemberReport(pid=pid, state="frozen")], **kw)


async def status_of(api: Api, method: str, path: str, **kw: Any) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON body of one request with the admin token."""
    headers = {"Authorization": f"Bearer {TOKEN}", **kw.pop("headers", {})}
    async with api.s.request(method, api.url + path, headers=headers, **kw) as r:
        return r.status, await r.json()


async def test_a_second_job_joins_the_generation_the_same_job_opens_the_next(
    api_factory: Factory,
) -> None:
    api, _srv, _ = await api_factory()
    a, b = vm(api.url, "job-a"), vm(api.url, "job-b")
    first = await a.group_freeze("g1", FreezeRequest(job="job-a", reason="notice", mode="resume"))
    assert (first.group, first.generation, first.job, first.joined) == ("g1", 1, "job-a", ["job-a"])
    assert (first.reason, first.mode) == ("notice", "resume")
    assert abs(first.opened_at - time.time()) < 60
    joined = await b.group_freeze("g1", FreezeRequest(job="job-b", reason="peer", mode="resume"))
    assert (joined.generation, joined.job, joined.joined) == (1, "job-a", ["job-a", "job-b"])
    assert (joined.reason, joined.mode) == ("notice", "resume")  # the opener's, not the joiner's
    await a.put_round("g1", "state", entry("job-a"))
    again = await a.group_freeze("g1", FreezeRequest(job="job-a", reason="retry"))
    assert (again.generation, again.job, again.joined, again.reason) == (
        2,
        "job-a",
        ["job-a"],
        "retry",
    )
    # the rounds of generation 1 are forgotten: the same round name is empty in generation 2
    forgotten = await a.get_round("g1", "state", have=0, wait_s=0)
    assert (forgotten.generation, forgotten.entries) == (2, [])
    # another group is another sequence
    other = await b.group_freeze("g2", FreezeRequest(job="job-b"))
    assert (other.group, other.generation) == ("g2", 1)


async def test_an_exit_takes_every_freeze_and_supersedes_a_resume(api_factory: Factory) -> None:
    """An exit in progress is joined by every member's freeze, a resume (the agent gives
    way) or the same job asking again (no second generation forgets its rounds); an exit
    asked while a resume is open opens the next; restored members meet in one generation."""
    api, _srv, _ = await api_factory()
    admin = ControllerClient(api.url, TOKEN)

    async def ask(job: str, mode: str) -> tuple[int, str, list[str]]:
        got = await admin.group_freeze(
            "g", FreezeRequest.model_validate({"job": job, "mode": mode})
        )
        return got.generation, got.mode, got.joined

    assert await ask("a", "resume") == (1, "resume", ["a"])
    assert await ask("b", "exit") == (2, "exit", ["b"])  # supersedes the pause
    assert await ask("a", "resume") == (2, "exit", ["b", "a"])  # joins the exit: gives way
    assert await ask("a", "exit") == (2, "exit", ["b", "a"])  # its drain follows, same one
    assert await ask("b", "exit") == (2, "exit", ["b", "a"])
    assert await ask("b", "restore") == (3, "restore", ["b"])
    assert await ask("a", "restore") == (3, "restore", ["b", "a"])
    assert await ask("a", "resume") == (4, "resume", ["a"])
    assert await ask("a", "resume") == (5, "resume", ["a"])  # a second pause


async def test_a_job_opens_a_new_generation_once_the_join_window_passed(
    api_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, srv, _ = await api_factory()
    now = [1000.0]
    srv.controller.rendezvous.clock = lambda: now[0]
    admin = ControllerClient(api.url, TOKEN)
    assert (await admin.group_freeze("g", FreezeRequest(job="a"))).generation == 1
    now[0] += rendezvous.JOIN_WINDOW_S - 1
    assert (await admin.group_freeze("g", FreezeRequest(job="b"))).joined == ["a", "b"]
    now[0] += 2  # generation 1 was opened JOIN_WINDOW_S + 1 s ago
    late = await admin.group_freeze("g", FreezeRequest(job="c"))
    assert (late.generation, late.job, late.joined) == (2, "c", ["c"])


async def test_watch_answers_at_once_past_after_and_after_the_wait_otherwise(
    api_factory: Factory,
) -> None:
    api, _srv, _ = await api_factory()
    a = vm(api.url, "job-a")
    none_yet = await a.watch_group("g", after=0, wait_s=0)
    assert (none_yet.group, none_yet.generation, none_yet.job) == ("g", 0, None)
    await a.group_freeze("g", FreezeRequest(job="job-a", reason="drain"))
    t0 = time.monotonic()
    seen = await a.watch_group("g", after=0, wait_s=20)
    assert time.monotonic() - t0 < 5  # at once, not after the 20 s
    assert (seen.generation, seen.job, seen.reason) == (1, "job-a", "drain")
    t0 = time.monotonic()
    same = await a.watch_group("g", after=1, wait_s=0.5)
    waited = time.monotonic() - t0
    assert 0.45 <= waited < 5, waited
    assert same.generation == 1


async def test_a_watch_wakes_when_another_job_opens_a_generation(api_factory: Factory) -> None:
    api, _srv, _ = await api_factory()
    a, b = vm(api.url, "job-a"), vm(api.url, "job-b")
    t0 = time.monotonic()
    watching = asyncio.create_task(a.watch_group("g", after=0, wait_s=25))
    await asyncio.sleep(0.3)
    assert not watching.done()
    await b.group_freeze("g", FreezeRequest(job="job-b", reason="preempt", mode="exit"))
    woke = await asyncio.wait_for(watching, 10)
    assert time.monotonic() - t0 < 10  # woken, not timed out at 25 s
    assert (woke.generation, woke.job, woke.reason) == (1, "job-b", "preempt")


async def test_a_round_holds_one_entry_per_job_the_last_put_wins(api_factory: Factory) -> None:
    api, _srv, _ = await api_factory()
    a, b = vm(api.url, "job-a"), vm(api.url, "job-b")
    await a.group_freeze("g", FreezeRequest(job="job-a"))
    one = await a.put_round("g", "state", entry("job-a", pid=10))
    assert (one.group, one.generation, one.round) == ("g", 1, "state")
    assert [(e.job, e.members[0].pid) for e in one.entries] == [("job-a", 10)]
    replaced = await a.put_round("g", "state", entry("job-a", pid=11, uids={"k": "ab"}))
    assert [(e.job, e.members[0].pid, e.uids) for e in replaced.entries] == [
        ("job-a", 11, {"k": "ab"})
    ]
    two = await b.put_round("g", "state", entry("job-b", abort="no GPU"))
    assert [(e.job, e.abort) for e in two.entries] == [("job-a", None), ("job-b", "no GPU")]
    read = await b.get_round("g", "state", have=0, wait_s=0)
    assert read == two
    assert (await b.get_round("g", "other", have=0, wait_s=0)).entries == []


async def test_get_round_waits_for_a_new_entry_or_for_wait_s(api_factory: Factory) -> None:
    api, _srv, _ = await api_factory()
    a, b = vm(api.url, "job-a"), vm(api.url, "job-b")
    await a.group_freeze("g", FreezeRequest(job="job-a"))
    await a.put_round("g", "uids", entry("job-a"))
    t0 = time.monotonic()
    waiting = asyncio.create_task(a.get_round("g", "uids", have=1, wait_s=25))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await a.put_round("g", "uids", entry("job-a", pid=2))  # a replacement is no new entry
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await b.put_round("g", "uids", entry("job-b"))
    got = await asyncio.wait_for(waiting, 10)
    assert time.monotonic() - t0 < 10
    assert [e.job for e in got.entries] == ["job-a", "job-b"]
    t0 = time.monotonic()
    nothing_new = await a.get_round("g", "uids", have=2, wait_s=0.5)
    assert 0.45 <= time.monotonic() - t0 < 5
    assert [e.job for e in nothing_new.entries] == ["job-a", "job-b"]
    t0 = time.monotonic()
    empty = await a.get_round("g", "never", have=0, wait_s=0.4)
    assert 0.35 <= time.monotonic() - t0 < 5
    assert (empty.round, empty.generation, empty.entries) == ("never", 1, [])


async def test_a_round_poll_answers_when_a_new_generation_opens(api_factory: Factory) -> None:
    api, _srv, _ = await api_factory()
    a = vm(api.url, "job-a")
    await a.group_freeze("g", FreezeRequest(job="job-a", mode="resume"))
    waiting = asyncio.create_task(a.get_round("g", "state", have=0, wait_s=25))
    await asyncio.sleep(0.3)
    await a.group_freeze("g", FreezeRequest(job="job-a", reason="again", mode="resume"))
    got = await asyncio.wait_for(waiting, 10)
    assert (got.generation, got.entries) == (2, [])


async def test_a_vm_token_acts_for_its_own_job_only(api_factory: Factory) -> None:
    api, srv, _ = await api_factory()
    a = vm(api.url, "job-a")
    with pytest.raises(AuthError, match="may not act for job 'job-b'") as refused:
        await a.put_round("g", "state", entry("job-b"))
    assert not refused.value.retryable
    with pytest.raises(AuthError, match="may not act for job 'job-b'"):
        await a.group_freeze("g", FreezeRequest(job="job-b"))
    status, body = await status_of(
        api,
        "PUT",
        routes.group_path(routes.GROUP_ROUND, "g", "state"),
        data=entry("job-b").model_dump_json(),
        headers={"Authorization": f"Bearer {TokenKeys(TOKEN).issue('job-a', 0)}"},
    )
    assert status == 403 and "job-b" in body["error"]
    assert "g" not in srv.controller.rendezvous.groups  # nothing of the refused calls was kept
    # any valid token may read; no token may not
    assert (await a.watch_group("g", after=0, wait_s=0)).generation == 0
    async with api.s.get(api.url + routes.group_path(routes.GROUP_FREEZE, "g")) as r:
        assert r.status == 401


@pytest.mark.parametrize("name", [".hidden", "-x", "a b", "x" * 129, "é"])
async def test_a_bad_group_or_round_name_is_a_400(api_factory: Factory, name: str) -> None:
    api, srv, _ = await api_factory()
    admin = ControllerClient(api.url, TOKEN)
    with pytest.raises(ControllerRefused, match="bad group name"):
        await admin.group_freeze(name, FreezeRequest(job="a"))
    with pytest.raises(ControllerRefused, match="bad round name"):
        await admin.put_round("g", name, entry("a"))
    for method, route in [
        ("GET", routes.group_path(routes.GROUP_FREEZE, name)),
        ("GET", routes.group_path(routes.GROUP_ROUND, "g", name)),
        ("GET", routes.group_path(routes.GROUP_ROUND, name, "r")),
    ]:
        status, body = await status_of(api, method, route)
        assert status == 400 and "name" in body["error"], (route, status, body)
    assert srv.controller.rendezvous.groups == {}  # refused before anything was made


async def test_bad_numbers_and_bodies_are_400s(api_factory: Factory) -> None:
    api, _srv, _ = await api_factory()
    freeze = routes.group_path(routes.GROUP_FREEZE, "g")
    rnd = routes.group_path(routes.GROUP_ROUND, "g", "r")
    for query in ["?after=-1", "?after=x", "?wait=nan", "?wait=inf", "?wait=soon"]:
        status, body = await status_of(api, "GET", freeze + query)
        assert status == 400, (query, body)
    status, body = await status_of(api, "GET", rnd + "?have=1.5")
    assert status == 400 and "have" in body["error"]
    status, body = await status_of(api, "POST", freeze, data=b'{"job": "a", "mode": "later"}')
    assert status == 400 and body["error"].startswith("malformed freeze request")
    status, body = await status_of(api, "PUT", rnd, data=b'{"job": "a", "extra": 1}')
    assert status == 400 and body["error"].startswith("malformed round entry")


async def test_an_entry_over_one_mib_is_a_413_before_it_is_parsed(api_factory: Factory) -> None:
    api, srv, _ = await api_factory()
    a = vm(api.url, "job-a")
    big = entry("job-a", uids={f"k{i}": "ab" * 4096 for i in range(140)})  # ~1.15 MB
    with pytest.raises(EventTooLarge, match="round entr"):
        await a.put_round("g", "state", big)
    status, body = await status_of(
        api, "PUT", routes.group_path(routes.GROUP_ROUND, "g", "r"), data=b"x" * (1024 * 1024 + 1)
    )
    assert status == 413 and body["code"] == "event_too_large"  # not "malformed": never parsed
    assert srv.controller.rendezvous.nbytes == 0
    # just under the limit is taken
    fits = entry("job-a", uids={f"k{i}": "ab" * 4096 for i in range(120)})
    assert len((await a.put_round("g", "state", fits)).entries) == 1


async def test_the_bounds_are_refused_with_a_typed_409(
    api_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, srv, _ = await api_factory()
    monkeypatch.setattr(rendezvous, "MAX_GROUPS", 2)
    monkeypatch.setattr(rendezvous, "MAX_ROUNDS", 2)
    monkeypatch.setattr(rendezvous, "MAX_ENTRIES", 2)
    admin = ControllerClient(api.url, TOKEN)
    await admin.group_freeze("g1", FreezeRequest(job="a", mode="resume"))
    await admin.watch_group("g2", after=0, wait_s=0)  # a watched group counts too
    with pytest.raises(ControllerRefused, match="2 NCCL groups already") as full:
        await admin.group_freeze("g3", FreezeRequest(job="a", mode="resume"))
    assert not full.value.retryable
    status, body = await status_of(api, "GET", routes.group_path(routes.GROUP_FREEZE, "g4"))
    assert status == 409 and "ControllerRefused" in body["error"]
    await admin.put_round("g1", "r1", entry("a"))
    await admin.put_round("g1", "r2", entry("a"))
    with pytest.raises(ControllerRefused, match="2 rounds already"):
        await admin.put_round("g1", "r3", entry("a"))
    await admin.put_round("g1", "r1", entry("b"))
    await admin.put_round("g1", "r1", entry("b", pid=7))  # a replacement is within bounds
    with pytest.raises(ControllerRefused, match="2 entries already"):
        await admin.put_round("g1", "r1", entry("c"))
    await admin.group_freeze(
        "g1", FreezeRequest(job="b", mode="resume")
    )  # joins: 2 jobs in generation 1
    with pytest.raises(ControllerRefused, match="2 jobs already"):
        await admin.group_freeze("g1", FreezeRequest(job="c", mode="resume"))
    # a new generation forgets the rounds, and with them their bytes
    rv = srv.controller.rendezvous
    assert rv.nbytes > 0
    await admin.group_freeze("g1", FreezeRequest(job="a", mode="resume"))
    assert rv.nbytes == 0
    await admin.put_round("g1", "r3", entry("a"))
    # the bytes of every entry held, all groups together
    monkeypatch.setattr(rendezvous, "MAX_BYTES", rv.nbytes + 100)
    with pytest.raises(ControllerRefused, match="bytes of round entries"):
        await admin.put_round("g1", "r3", entry("b", uids={"k": "x" * 200}))


async def test_a_group_idle_for_a_day_makes_room_for_a_new_one(
    api_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, srv, _ = await api_factory()
    monkeypatch.setattr(rendezvous, "MAX_GROUPS", 1)
    now = [0.0]
    rv = srv.controller.rendezvous
    rv.clock = lambda: now[0]
    admin = ControllerClient(api.url, TOKEN)
    await admin.group_freeze("old", FreezeRequest(job="a"))
    await admin.put_round("old", "r", entry("a"))
    now[0] += rendezvous.IDLE_S - 10
    with pytest.raises(ControllerRefused):
        await admin.group_freeze("new", FreezeRequest(job="a"))
    now[0] += 20
    assert (await admin.group_freeze("new", FreezeRequest(job="a"))).generation == 1
    assert list(rv.groups) == ["new"] and rv.nbytes == 0


async def test_stopping_the_controller_ends_its_long_polls(tmp_path: Path) -> None:
    srv = ControllerServer(
        settings(tmp_path), provider=local(tmp_path), image=ImageSettings.model_validate({})
    )
    await srv.__aenter__()
    try:
        a = vm(srv.url, "job-a")
        polls = [
            asyncio.create_task(a.watch_group("g", after=0, wait_s=30)),
            asyncio.create_task(a.get_round("g", "r", have=0, wait_s=30)),
        ]
        await asyncio.sleep(0.3)
    finally:
        t0 = time.monotonic()
        await srv.__aexit__(None, None, None)
    assert time.monotonic() - t0 < 10
    watched, got = await asyncio.wait_for(asyncio.gather(*polls), 10)
    assert watched.generation == 0 and got.entries == []


def test_group_path_quotes_each_name_as_one_segment() -> None:
    assert routes.group_path(routes.GROUP_FREEZE, "a b") == "/v1/groups/a%20b/freeze"
    assert routes.group_path(routes.GROUP_ROUND, "g", "r/1") == "/v1/groups/g/rounds/r%2F1"
    with pytest.raises(ValueError, match="needs a round"):
        routes.group_path(routes.GROUP_ROUND, "g")


async def test_a_rebuild_waiting_when_a_new_generation_opens_meets_the_others_there(
    api_factory: Factory,
) -> None:
    """A member whose exit failed after the group released waits, in its bring-back, for the
    rebuild; the others, restored elsewhere, open a ``restore`` generation and wait there. The
    waiting member's entry was in the old generation's round: it used to stay there, and both
    sides waited out their time. It is now put again in the current generation's round."""
    from spotguard.agent.groups import ControllerPeers

    api, _srv, _ = await api_factory()
    both = {"a", "b"}

    def full(es: list[RoundEntry]) -> bool:
        return {e.job for e in es} == both

    await vm(api.url, "b").group_freeze("g", FreezeRequest(job="b", mode="exit"))  # gen 1
    a = ControllerPeers(vm(api.url, "a"), "g", "a")  # its bring-back: no begin, no generation
    waiting = asyncio.create_task(a.exchange("rebuild", entry("a"), full, 8.0))
    await asyncio.sleep(0.5)
    b = ControllerPeers(vm(api.url, "b"), "g", "b")
    assert await b.begin("restore", "rebuild after the restore") == 2
    got_b = await b.exchange("rebuild", entry("b"), full, 8.0)
    got_a = await asyncio.wait_for(waiting, 8.0)
    assert {e.job for e in got_a} == both == {e.job for e in got_b}
