"""Ways a fleet loses a job at the controller (issue 31), over real HTTP with the local
provider whose "VMs" run the stand-in agent (sg_standin_agent.py):

* the restart budget counts relaunch rounds in a row that did not restore the job, reset by
  each successful restore, so a multi-day job survives any number of interruptions;
* a FAILED job can be retried from the controller (``jobs retry``, ``migrate --now``);
* what agents send is validated at the edge: a report without instance facts (``cloud=none``)
  or with fields this controller does not know never poisons the job's answers or
  ``jobs list``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from controller_helpers import TOKEN, VM1, Api, Factory
from test_controller_park import cli

from sgtest import free_port
from spotguard.contracts import EventKind, make_event

pytestmark = pytest.mark.timeout(120)


def _image(tmp_path: Path, job: str, n: int = 0) -> str:
    return f"file://{tmp_path}/store/{job}/images/20261122T00000{n}000000Z-abc12{n}"


async def _retry(api: Api, job: str, body: Any = None) -> dict[str, Any]:
    async with api.s.post(
        f"{api.url}/v1/jobs/{job}/retry",
        data=json.dumps(body) if body is not None else b"",
        headers={"Authorization": f"Bearer {TOKEN}"},
    ) as r:
        out: dict[str, Any] = await r.json()
        out["_status"] = r.status
        return out


async def test_restart_budget_counts_failed_recoveries_in_a_row_not_a_lifetime(
    api_factory: Factory, tmp_path: Path
) -> None:
    """max_restarts=2 and five interruptions, each followed by a good relaunch: the job is
    protected after every one (the old code failed it at the third: "max restarts (2)")."""
    api, _, _ = await api_factory(max_restarts=2)
    job = "multi-day"
    await api.event(job, EventKind.STARTED, instance=VM1)
    where = dict(VM1)
    for n in range(5):
        r = await api.event(job, EventKind.EXITED, instance=where, image_url=_image(tmp_path, job))
        assert r["state"] == "launching", (n, r.get("reason"))
        view = await api.wait_state(job, "protected")
        assert view["instance"]["instance_id"] != where["instance_id"]
        where = {"provider": "local", "instance_id": view["instance"]["instance_id"]}
        assert view["data"].get("failed_rounds", 0) == 0  # reset by the restore
    assert view["restarts"] == 5  # every relaunch is still counted, for the record


async def test_a_failed_job_can_be_retried_from_the_controller(
    api_factory: Factory, tmp_path: Path
) -> None:
    """A job that used up its budget (first VM lost, max_restarts=1) is FAILED; ``jobs retry``
    (the CLI, over the API) opens a fresh budget and the next VM restores it. The old
    controller had no way back: migrate and unpark both answered 409."""
    marker = tmp_path / "lost-once"
    api, srv, _ = await api_factory(
        env={"STANDIN_LOSE_FIRST": str(marker)}, liveness_s=0.1, max_restarts=1
    )
    job = "retry-me"
    await api.event(job, EventKind.STARTED, instance=VM1)
    await api.event(job, EventKind.EXITED, instance=VM1, image_url=_image(tmp_path, job))
    view = await api.wait_state(job, "failed")
    assert view["reason"].startswith("max restarts (1) reached")
    rc, out, err = await cli(srv.url, "jobs", "retry", job)
    assert rc == 0, err
    assert out.startswith(f"{job}: launching"), out
    view = await api.wait_state(job, "protected")
    assert view["instance"]["instance_id"] not in (marker.read_text(), "vm-first")
    assert any("retry" in h["reason"] for h in view["history"])
    # a job that is not failed is refused with one line, and left as it is
    r = await _retry(api, job)
    assert r["_status"] == 409 and "not failed" in r["error"], r
    rc, _, err = await cli(srv.url, "jobs", "retry", "no-such-job")
    assert rc == 1 and err.startswith("spotguard: error:") and "Traceback" not in err


async def test_migrate_now_brings_back_a_failed_job(api_factory: Factory, tmp_path: Path) -> None:
    marker = tmp_path / "lost-once"
    api, _, _ = await api_factory(
        env={"STANDIN_LOSE_FIRST": str(marker)}, liveness_s=0.1, max_restarts=1
    )
    job = "mig-failed"
    await api.event(job, EventKind.STARTED, instance=VM1)
    await api.event(job, EventKind.EXITED, instance=VM1, image_url=_image(tmp_path, job))
    await api.wait_state(job, "failed")
    r = await api.migrate(job, {"to": "local", "immediate": True})
    assert (r["_status"], r["state"]) == (200, "launching"), r
    await api.wait_state(job, "protected")


async def test_a_report_without_instance_facts_never_poisons_the_job(
    api_factory: Factory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The relaunched VM's agent runs with ``cloud=none``: its reports name no instance, so
    the controller used to store the launched InstanceRef (provider, market, state, ...) as
    the job's instance, and every answer for the job — and ``jobs list`` for every job —
    became a 500 (``extra_forbidden``); the drain's reports then never arrived."""
    api, srv, _ = await api_factory(env={"STANDIN_NO_FACTS": "1"})
    await api.event("other", EventKind.STARTED, instance=VM1 | {"instance_id": "vm-other"})
    job = "no-facts"
    view = await _relaunched_then_started_without_facts(api, job, tmp_path)
    assert view["_status"] == 200 and view["state"] == "protected"
    listed = await api.get("/v1/jobs")
    assert listed["_status"] == 200, listed
    assert {j["job"] for j in listed["jobs"]} == {"other", job}
    # the next drain from the same agent (no facts again) is applied: the job moves on
    r = await api.event(job, EventKind.EXITED, instance={}, image_url=_image(tmp_path, job, 1))
    assert (r["_status"], r["state"]) == (200, "launching"), r
    rc, out, err = await cli(srv.url, "jobs", "list")
    assert rc == 0 and job in out, err


async def _relaunched_then_started_without_facts(
    api: Api, job: str, tmp_path: Path
) -> dict[str, Any]:
    await api.event(job, EventKind.STARTED, instance=VM1)
    await api.event(job, EventKind.EXITED, instance=VM1, image_url=_image(tmp_path, job))
    loop = asyncio.get_running_loop()
    end = loop.time() + 20
    while (view := await api.get(f"/v1/jobs/{job}")).get("state") != "protected":
        assert loop.time() < end, view  # the stand-in restores it on a local VM
        await asyncio.sleep(0.05)
    r = await api.event(job, EventKind.STARTED, instance={}, pid=7)  # its agent restarted
    assert r["_status"] == 200, r
    return await api.get(f"/v1/jobs/{job}")


async def test_an_unexpected_field_in_a_report_is_recorded_ignored_and_logged_once(
    api_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A newer agent adds a field the controller does not know (inside the instance facts
    and at the top): the report is applied, the field recorded in the job's history and
    logged once per (kind, field), never a 400 that the agent would retry for ever."""
    api, _, _ = await api_factory()
    job = "newer-agent"
    ev = json.loads(make_event(job=job, kind=EventKind.STARTED, instance=VM1).model_dump_json())
    ev["instance"]["ami"] = "ami-123"
    ev["colour_depth"] = 24
    caplog.set_level(logging.WARNING, logger="spotguard.controller")
    for n in range(3):
        ev["event_id"] = f"newer-{n}"
        r = await api.post_raw(json.dumps(ev))
        assert (r["_status"], r["state"]) == (200, "protected"), r
    view = await api.get(f"/v1/jobs/{job}")
    ignored = [h["detail"].get("ignored") for h in view["history"] if h["detail"].get("ignored")]
    assert ignored and sorted(ignored[0]) == ["colour_depth", "instance.ami"], view["history"]
    lines = [r for r in caplog.records if "unexpected field" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    listed = await api.get("/v1/jobs")
    assert listed["_status"] == 200


async def _serve_until_healthy(argv: list[str], url: str) -> tuple[int | None, str]:
    """Run ``spotguard controller`` until it answers /healthz (then stop it) or exits."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    loop = asyncio.get_running_loop()
    end = loop.time() + 30
    async with aiohttp.ClientSession() as s:
        while proc.returncode is None and loop.time() < end:
            try:
                async with s.get(url + "/healthz") as r:
                    if r.status == 200:
                        proc.send_signal(signal.SIGTERM)
                        break
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 0.05)
    out, _ = await proc.communicate()
    return proc.returncode, out.decode()


async def test_an_empty_state_file_is_refused_at_start_unless_initialised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 0-byte controller.db (a restored backup of nothing, a disk that lost the file's
    blocks) used to start as "no jobs" without a word: every parked or launching job was
    forgotten. It is refused with one line naming --init-state, and left as it is; with
    --init-state it is initialised (logged) and the controller serves."""
    state = tmp_path / "controller.db"
    state.write_bytes(b"")
    exe = str(Path(sys.executable).with_name("spotguard"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [exe, "controller", "--state", str(state), "--listen", f"127.0.0.1:{port}"]
    monkeypatch.setenv("SPOTGUARD_CONTROLLER_TOKEN", TOKEN)
    rc, out = await _serve_until_healthy(argv, url)
    assert rc == 2, out  # the operator must act: the unit's RestartPreventExitStatus=2
    last = out.strip().splitlines()[-1]
    assert last.startswith("spotguard: error: state file") and "--init-state" in last, out
    assert "Traceback" not in out
    assert state.read_bytes() == b""  # left as it is
    rc, out = await _serve_until_healthy([*argv, "--init-state"], url)
    assert rc == 0, out
    assert "initialised" in out and state.stat().st_size > 0
    rc, out = await _serve_until_healthy(argv, url)  # once initialised, no flag needed
    assert rc == 0, out


async def test_the_older_image_after_a_corrupt_one_is_chosen_by_sequence_not_by_clock(
    api_factory: Factory, tmp_path: Path
) -> None:
    """The job's first image was written on a VM whose clock ran a day ahead (its id says
    tomorrow), the second on a good clock. The second cannot be restored: the older image
    by the store's authenticated sequence is the first. The old controller compared ids
    (wall clocks), found nothing "older" than today's and failed the job."""
    from test_controller_fencing import post, write_image

    from spotguard.contracts import new_image_id
    from spotguard.image import ImageSettings, push_dir

    src = tmp_path / "img-fast-clock"
    src.mkdir()
    (src / "pages-1.img").write_bytes(b"\x01" * 4096)
    tomorrow = new_image_id(datetime.now(UTC) + timedelta(days=1))
    first = (
        await push_dir(
            src, f"file://{tmp_path}/store", "skewed", {}, image_id=tomorrow,
            settings=ImageSettings(),
        )
    ).image_url  # fmt: skip
    second = await write_image(tmp_path, "skewed", 2)
    assert second.rsplit("/", 1)[-1] < first.rsplit("/", 1)[-1]  # ids say the reverse
    api, _, _ = await api_factory(
        env={"STANDIN_FAIL": "ImageCorrupt", "STANDIN_FAIL_IMAGE": second}, max_restarts=5
    )
    vm1 = {"provider": "local", "instance_id": "vm1"}
    await post(api, TOKEN, "skewed", EventKind.STARTED, instance=vm1)
    await post(api, TOKEN, "skewed", EventKind.EXITED, instance=vm1, image_url=second)
    view = await api.wait_state("skewed", "protected", within=30)
    assert view["image_url"] == first
    assert any(f"falling back to the older image {first}" in h["reason"] for h in view["history"])


#: reports with numbers no agent sends: each must be refused (4xx), never a 500, and leave
#: the job's answers and ``jobs list`` whole
OUT_OF_RANGE: list[tuple[EventKind, dict[str, Any]]] = [
    (EventKind.DURABLE, {"image_url": "file:///s/j/images/x", "freeze_seconds": 1e308}),
    (EventKind.DURABLE, {"image_url": "file:///s/j/images/x", "pause_seconds": "NaN"}),
    (EventKind.DURABLE, {"image_url": "file:///s/j/images/x", "image_bytes": 10**30}),
    (EventKind.DURABLE, {"image_url": "file:///s/j/images/x", "stored_bytes": 10**30}),
    (EventKind.STARTED, {"epoch": 10**30}),
    (EventKind.STARTED, {"pid": 10**30}),
    (EventKind.RESTORED, {"image_url": "file:///s/j/images/x", "seconds": "Infinity"}),
    (EventKind.RESTORED, {"image_url": "file:///s/j/images/x", "attempt": 10**30}),
    (EventKind.FROZEN, {"mode": "exit", "notice_to_frozen_s": -1e308}),
]


async def test_a_report_with_numbers_out_of_range_is_a_4xx_and_never_poisons_the_job(
    api_factory: Factory, tmp_path: Path
) -> None:
    """inf, NaN, 1e308 and integers past any sane size were taken as they came: an integer
    SQLite cannot hold made the report a 500 (the agent retries it for ever), a float one
    stayed in the job's record. Now the edge refuses each with a 400 and the job's answers
    stay whole."""
    api, _, _ = await api_factory()
    job = "bounded"
    assert (await api.event(job, EventKind.STARTED, instance=VM1))["_status"] == 200
    for n, (kind, fields) in enumerate(OUT_OF_RANGE):
        ok = {k: v for k, v in fields.items() if k in ("image_url", "mode")}
        ev = json.loads(make_event(job=job, kind=kind, instance=VM1, **ok).model_dump_json())
        ev.update(fields, event_id=f"bad-{n}")
        body = json.dumps(ev).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity")
        r = await api.post_raw(body)
        assert 400 <= r["_status"] < 500, (kind, fields, r)
    view = await api.get(f"/v1/jobs/{job}")
    assert (view["_status"], view["state"]) == (200, "protected"), view
    assert len(view["history"]) == 1, view["history"]  # the first report only
    listed = await api.get("/v1/jobs")
    assert listed["_status"] == 200 and [j["job"] for j in listed["jobs"]] == [job], listed
    r = await api.event(job, EventKind.EXITED, instance=VM1, image_url=_image(tmp_path, job))
    assert (r["_status"], r["state"]) == (200, "launching"), r
