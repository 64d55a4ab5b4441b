"""Parked jobs at the controller, over real HTTP with the local provider: a job parked to a
store is held as ``parked`` (never finished, never relaunched on its own), ``jobs unpark``
relaunches it through the recovery path onto a new local VM (the stand-in agent restores
it), and unparking a job that is not parked is refused with one clear line."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from controller_helpers import TOKEN, VM1, Api, Factory, held_state

from spotguard.contracts import EventKind, make_event, token_scope


async def cli(url: str, *args: str) -> tuple[int, str, str]:
    exe = str(Path(sys.executable).with_name("spotguard"))
    env = {"PATH": "/usr/bin:/bin", "SPOTGUARD_CONTROLLER_URL": url}
    env["SPOTGUARD_CONTROLLER_TOKEN"] = TOKEN
    if "PYTHONPATH" in os.environ:  # the sources under test
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = await asyncio.create_subprocess_exec(
        exe, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()


async def unpark(api: Api, job: str, body: Any = None) -> dict[str, Any]:
    async with api.s.post(
        f"{api.url}/v1/jobs/{job}/unpark",
        data=json.dumps(body) if body is not None else b"",
        headers={"Authorization": f"Bearer {TOKEN}"},
    ) as r:
        out: dict[str, Any] = await r.json()
        out["_status"] = r.status
        return out


def vms(tmp_path: Path) -> list[Path]:
    root = tmp_path / "local" / "vms"
    return sorted(root.iterdir()) if root.exists() else []


async def test_parked_job_is_held_then_unparked_onto_a_new_local_vm(
    api_factory: Factory, tmp_path: Path
) -> None:
    api, srv, _ = await api_factory(notice_grace_s=0.1)
    job = "nb"
    image = f"file://{tmp_path}/store/{job}/images/20261122T000000000000Z-abc123"
    await api.event(job, EventKind.STARTED, instance=VM1, pid=42)
    parked = make_event(
        EventKind.PARKED, job=job, instance=VM1, image_url=image, image_bytes=4096,
        reason="idle for 3600 s",
    )  # fmt: skip
    r = await api.post_raw(parked.model_dump_json())
    assert (r["_status"], r["state"]) == (200, "parked")
    assert r["reason"] == f"parked to {image} on vm-first (idle for 3600 s)"
    assert (await api.post_raw(parked.model_dump_json()))["duplicate"] is True
    # A notice for the node it was parked on changes nothing: no VM holds the job.
    notice = {"id": "n1", "kind": "preempt", "deadline": "2020-01-01T00:00:00Z"}
    r = await api.event(job, EventKind.NOTICE, instance=VM1, notice=notice)
    assert r["state"] == "parked"
    view = await held_state(api, job, "parked", 1.0)  # the loop never relaunches it on its own
    assert vms(tmp_path) == []
    assert view["data"]["parked_image"] == image
    assert [i["image_url"] for i in view["images"]] == [image]
    rc, out, err = await cli(srv.url, "jobs", "list")
    assert rc == 0, err
    assert "parked" in out and "finished" not in out

    # Where to is checked as migrate checks it; the job stays parked when it is refused.
    r = await unpark(api, job, {"to": "p9.nonesuch"})
    assert r["_status"] == 400 and "UnknownInstanceType" in r["error"]
    r = await unpark(api, job, {"to": "eu-west-1"})
    assert r["_status"] == 400 and "NoMatchingOffer" in r["error"]
    r = await unpark(api, job, {"to": "local", "colour": 1})
    assert r["_status"] == 400 and "malformed unpark request" in r["error"]
    assert (await api.get(f"/v1/jobs/{job}"))["state"] == "parked"

    rc, out, err = await cli(srv.url, "jobs", "unpark", job, "--to", "local", "--json")
    assert rc == 0, err
    answer = json.loads(out)
    assert answer["state"] == "launching"
    assert answer["owner"] == {"instance_id": None, "epoch": 1}
    view = await api.wait_state(job, "protected")
    vm = view["instance"]["instance_id"]
    assert vm.startswith("vm-") and vm != "vm-first"
    assert (view["owner"]["epoch"], view["restarts"], view["image_url"]) == (1, 1, image)
    moves = [(h["from"], h["to"]) for h in view["history"] if h["from"] != h["to"]]
    assert moves == [
        (None, "protected"),
        ("protected", "parked"),
        ("parked", "launching"),
        ("launching", "restoring"),
        ("restoring", "protected"),
    ]
    assert any(
        h["reason"] == f"unpark in local from the parked image {image}" for h in view["history"]
    )
    # The VM got the assignment a recovery gives: the parked image, a token for epoch 1.
    assignment = json.loads((tmp_path / "local" / "vms" / vm / "assignment.json").read_text())
    assert (assignment["image_url"], assignment["epoch"]) == (image, 1)
    assert token_scope(assignment["controller_token"]) == (job, 1)
    # The node it was parked on is left alone (other jobs may use its GPUs).
    assert not any("terminated old instance" in h["reason"] for h in view["history"])
    # Its agent, should it unpark the job there by hand now, is told it lost the job.
    r = await api.event(job, EventKind.STARTED, instance=VM1, epoch=0)
    assert (r["_status"], r["stand_down"]) == (409, True)


async def test_unpark_of_a_job_that_is_not_parked_is_one_clear_error(
    api_factory: Factory,
) -> None:
    api, srv, _ = await api_factory()
    await api.event("busy", EventKind.STARTED, instance=VM1)
    r = await unpark(api, "busy")
    assert r["_status"] == 409
    assert r["error"] == (
        "ControllerError: job 'busy' is protected, not parked; only a job parked to a store "
        "can be unparked through the controller"
    )
    rc, out, err = await cli(srv.url, "jobs", "unpark", "busy")
    assert rc == 1 and out == ""
    assert "job 'busy' is protected, not parked" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert (await api.get("/v1/jobs/busy"))["state"] == "protected"
    rc, _, err = await cli(srv.url, "jobs", "unpark", "nope")
    assert rc == 1 and "no job 'nope'" in err
    await api.event("busy", EventKind.JOB_FINISHED, instance=VM1)
    r = await unpark(api, "busy")
    assert r["_status"] == 409 and "is finished, not parked" in r["error"]


async def test_parked_job_unparked_by_hand_on_its_node_is_protected_again(
    api_factory: Factory, tmp_path: Path
) -> None:
    api, _, _ = await api_factory()
    image = f"file://{tmp_path}/store/byhand/images/20261122T000000000000Z-abc123"
    await api.event("byhand", EventKind.STARTED, instance=VM1)
    r = await api.event("byhand", EventKind.PARKED, instance=VM1, image_url=image)
    assert r["state"] == "parked"
    r = await api.event("byhand", EventKind.STARTED, instance=VM1, pid=4242)
    assert (r["state"], r["instance"]["instance_id"]) == ("protected", "vm-first")
    assert (await api.get("/v1/jobs/byhand"))["data"].get("parked_image") is None
    assert (await unpark(api, "byhand"))["_status"] == 409
