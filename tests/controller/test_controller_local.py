"""The controller over real HTTP with the local provider: agent events shaped exactly like
the agent's drive the state machine; relaunches start real local "VM" processes whose
stand-in agent (sg_standin_agent.py) reports back over HTTP."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from controller_helpers import TOKEN, VM1, Api, Factory, held_state

from spotguard.contracts import EventKind, make_event
from spotguard.image import ImageSettings, push_dir
from spotguard.notices.base import Cloud, Notice, NoticeKind
from spotguard.providers.base import InstanceRef, Market
from spotguard.providers.local import LocalProvider


async def test_unauthenticated_and_malformed_requests_get_clear_errors(
    api_factory: Factory,
) -> None:
    api, _, _ = await api_factory()
    ok = make_event(job="j1", kind=EventKind.STARTED, instance=VM1).model_dump_json()
    r = await api.post_raw(ok, token=None)
    assert (r["_status"], r["error"]) == (401, "missing bearer token")
    r = await api.post_raw(ok, token="wrong")
    assert (r["_status"], r["error"]) == (401, "wrong bearer token")
    r = await api.post_raw("{not json")
    assert r["_status"] == 400
    assert "malformed event" in r["error"]
    r = await api.post_raw('{"job": "j1", "kind": "started", "pid": "many", "colour": "red"}')
    assert r["_status"] == 400  # a bad value (an unknown field alone is only dropped)
    assert "pid" in r["error"]
    r = await api.post_raw('{"job": "Bad Name!", "kind": "started"}')
    assert r["_status"] == 400
    assert "invalid job name" in r["error"]
    r = await api.post_raw('{"job": "j1", "kind": "exploded"}')
    assert r["_status"] == 400
    assert "kind" in r["error"]
    assert (await api.get("/v1/jobs"))["jobs"] == []  # nothing was recorded
    async with api.s.get(api.url + "/healthz") as h:
        assert (await h.json())["ok"] is True


async def test_notice_durable_exit_relaunches_a_local_vm_that_restores(
    api_factory: Factory, tmp_path: Path
) -> None:
    api, srv, _ = await api_factory()
    job = "train-local"
    r = await api.event(job, EventKind.STARTED, instance=VM1, pid=42)
    assert r["state"] == "protected"
    deadline = (datetime.now(UTC) + timedelta(seconds=120)).isoformat()
    notice = {"id": "n1", "cloud": "aws", "kind": "preempt", "deadline": deadline}
    r = await api.event(job, EventKind.NOTICE, instance=VM1, notice=notice)
    assert r["state"] == "interrupting"
    image = f"file://{tmp_path}/store/{job}/images/20261122T000000000000Z-abc123"
    durable = make_event(
        job=job, kind=EventKind.DURABLE, instance=VM1, image_url=image, image_bytes=10
    )
    r = await api.post_raw(durable.model_dump_json())
    assert r["state"] == "checkpointed"
    again = await api.post_raw(durable.model_dump_json())  # a retried report: no-op
    assert again["duplicate"] is True
    assert again["state"] == "checkpointed"
    r = await api.event(job, EventKind.EXITED, instance=VM1, image_url=image)
    assert r["state"] == "launching"
    view = await api.wait_state(job, "protected")
    assert view["instance"]["instance_id"].startswith("vm-")
    assert view["instance"]["instance_id"] != "vm-first"
    assert view["restarts"] == 1
    assert [i["image_url"] for i in view["images"]] == [image]
    moves = [(h["from"], h["to"]) for h in view["history"] if h["from"] != h["to"]]
    assert moves == [
        (None, "protected"),
        ("protected", "interrupting"),
        ("interrupting", "checkpointed"),
        ("checkpointed", "launching"),
        ("launching", "restoring"),
        ("restoring", "protected"),
    ]
    durable_rows = [h for h in view["history"] if h["detail"].get("event_id") == durable.event_id]
    assert len(durable_rows) == 1
    # the VM got the assignment the agent reads at boot
    vm_dir = tmp_path / "local" / "vms" / view["instance"]["instance_id"]
    assignment = (vm_dir / "assignment.json").read_text()
    assert image in assignment
    assert srv.url in assignment
    async with api.s.get(api.url + "/metrics") as m:
        text = await m.text()
    assert 'spotguard_controller_launches_total{outcome="launched"} 1.0' in text


async def test_notice_without_durable_image_falls_back_to_newest_image_in_store(
    api_factory: Factory, tmp_path: Path
) -> None:
    api, _, _ = await api_factory()
    job = "fallback-job"
    src = tmp_path / "img"
    src.mkdir()
    (src / "pages-1.img").write_bytes(b"x" * 1000)
    store = f"file://{tmp_path}/store"
    manifest = await push_dir(src, store, job, {}, settings=ImageSettings())
    del manifest
    await api.event(job, EventKind.STARTED, instance=VM1)
    notice = {"id": "n2", "kind": "preempt", "deadline": datetime.now(UTC).isoformat()}
    await api.event(job, EventKind.NOTICE, instance=VM1, notice=notice)
    view = await api.wait_state(job, "protected")
    assert view["image_url"].startswith(f"{store}/{job}/images/")
    assert any("newest image" in h["reason"] for h in view["history"])


async def test_no_image_anywhere_and_give_up_restore_errors_mark_the_job_failed(
    api_factory: Factory,
) -> None:
    api, _, _ = await api_factory(env={"STANDIN_FAIL": "MismatchError"})
    await api.event("no-image", EventKind.STARTED, instance=VM1)
    await api.event("no-image", EventKind.EXITED, instance=VM1)
    view = await api.wait_state("no-image", "failed")
    assert "holds no complete image" in view["reason"]

    job = "mismatch"
    await api.event(job, EventKind.STARTED, instance=VM1)
    await api.event(job, EventKind.EXITED, instance=VM1, image_url="file:///s/mismatch/images/x")
    view = await api.wait_state(job, "failed")
    assert "MismatchError" in view["reason"]
    # the instance that could not restore is terminated
    await asyncio.sleep(0.3)
    hist = (await api.get(f"/v1/jobs/{job}"))["history"]
    assert any("terminated old instance" in h["reason"] for h in hist)


async def test_migrate_rejects_unknown_type_and_region_without_offers(api_factory: Factory) -> None:
    api, _, _ = await api_factory()
    await api.event("mig", EventKind.STARTED, instance=VM1)
    r = await api.migrate("mig", {"to": "p9.nonesuch"})
    assert r["_status"] == 400
    assert "UnknownInstanceType" in r["error"]
    r = await api.migrate("mig", {"to": "eu-west-1"})
    assert r["_status"] == 400
    assert "NoMatchingOffer" in r["error"]
    r = await api.migrate("nope", {"to": "local"})
    assert r["_status"] == 404
    r = await api.migrate("mig", {"to": "local", "colour": 1})
    assert r["_status"] == 400
    r = await api.migrate("mig", {"to": "local"})
    assert r["_status"] == 200
    assert r["action"] == "drain"  # the agent learns it from its next event's answer
    assert r["state"] == "protected"


class ScriptedSource:
    """A NoticeSource that yields the notices it is given (like the fleet SQS source)."""

    name = "scripted"

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Notice] = asyncio.Queue()

    async def watch(self) -> AsyncIterator[Notice]:
        while True:
            yield await self.queue.get()

    async def aclose(self) -> None:
        return None


async def test_fleet_notice_maps_instance_id_to_its_job(api_factory: Factory) -> None:
    src = ScriptedSource()
    api, _, _ = await api_factory(sources=[src], notice_grace_s=60)
    await api.event("fleet-job", EventKind.STARTED, instance={**VM1, "instance_id": "i-0abc"})
    await api.event("other-job", EventKind.STARTED, instance={**VM1, "instance_id": "i-0def"})
    deadline = datetime.now(UTC) + timedelta(minutes=2)
    n = Notice(
        "fleet-1",
        Cloud.FLEET,
        NoticeKind.PREEMPT,
        deadline,
        "terminate",
        raw={"instance-id": "i-0abc"},
    )
    await src.queue.put(n)
    view = await api.wait_state("fleet-job", "interrupting")
    assert view["data"]["notice"]["id"] == "fleet-1"
    assert (await api.get("/v1/jobs/other-job"))["state"] == "protected"
    await src.queue.put(n.cancel())
    await api.wait_state("fleet-job", "protected")


async def cli(url: str, *args: str, token: str = TOKEN) -> tuple[int, str, str]:
    exe = str(Path(sys.executable).with_name("spotguard"))
    env = {"PATH": "/usr/bin:/bin", "SPOTGUARD_CONTROLLER_URL": url}
    if token:
        env["SPOTGUARD_CONTROLLER_TOKEN"] = token
    proc = await asyncio.create_subprocess_exec(
        exe, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()


async def test_jobs_list_show_and_migrate_commands(api_factory: Factory) -> None:
    api, srv, _ = await api_factory()
    await api.event("cli-job", EventKind.STARTED, instance=VM1)
    image = "file:///s/cli-job/images/1"
    await api.event("cli-job", EventKind.DURABLE, instance=VM1, image_url=image)
    rc, out, err = await cli(srv.url, "jobs", "list")
    assert rc == 0, err
    assert "cli-job" in out
    assert "protected" in out
    assert "vm-first" in out
    rc, out, err = await cli(srv.url, "jobs", "show", "cli-job")
    assert rc == 0, err
    assert "periodic image file:///s/cli-job/images/1 is durable" in out
    assert "images:" in out
    rc, out, _ = await cli(srv.url, "jobs", "show", "cli-job", "--json")
    assert json.loads(out)["image_url"] == image
    rc, _, err = await cli(srv.url, "jobs", "show", "nope")
    assert rc == 1
    assert "no job 'nope'" in err
    assert "Traceback" not in err
    rc, _, err = await cli(srv.url, "jobs", "list", token="bad")
    assert rc == 1
    assert "refused the token" in err
    rc, _, err = await cli(srv.url, "migrate", "cli-job", "--to", "p9.huge")
    assert rc == 1
    assert "the controller refused: unknown instance type 'p9.huge'" in err, err
    rc, out, err = await cli(srv.url, "migrate", "cli-job", "--to", "local", "--now")
    assert rc == 0, err
    assert "launching" in out
    await api.wait_state("cli-job", "protected")


async def relaunched(api: Api, job: str, tmp_path: Path) -> dict[str, Any]:
    """A job relaunched onto a local VM by the controller (image durable, VM 1 exited)."""
    await api.event(job, EventKind.STARTED, instance=VM1)
    image = f"file://{tmp_path}/store/{job}/images/20261122T000000000000Z-abc123"
    await api.event(job, EventKind.EXITED, instance=VM1, image_url=image)
    return await api.wait_state(job, "protected")


def vm_alive(prov: LocalProvider, vm_id: str) -> Any:
    ref = InstanceRef("local", vm_id, "local", "local-1", "local", Market.ON_DEMAND)
    return prov.describe(ref)


async def test_job_finished_terminates_the_instance_the_controller_launched(
    api_factory: Factory, tmp_path: Path
) -> None:
    api, _, prov = await api_factory()
    view = await relaunched(api, "done-job", tmp_path)
    vm = view["instance"]["instance_id"]
    assert (await vm_alive(prov, vm)).state.value == "running"
    r = await api.event("done-job", EventKind.JOB_FINISHED, instance=view["instance"])
    assert r["state"] == "finished"
    assert "terminating the instance the controller launched" in r["reason"]
    loop = asyncio.get_running_loop()
    end = loop.time() + 20
    note = f"terminated old instance(s) ['{vm}']"
    while not any(note in h["reason"] for h in (await api.get("/v1/jobs/done-job"))["history"]):
        assert loop.time() < end, "the finished job's VM was never terminated"
        await asyncio.sleep(0.05)
    assert (await vm_alive(prov, vm)).state.value == "terminated"
    vm_json = json.loads((tmp_path / "local" / "vms" / vm / "vm.json").read_text())
    assert vm_json["terminated"] is True


async def test_job_finished_keeps_the_instance_when_configured(
    api_factory: Factory, tmp_path: Path
) -> None:
    api, _, prov = await api_factory(terminate_finished=False)
    view = await relaunched(api, "keep-job", tmp_path)
    vm = view["instance"]["instance_id"]
    r = await api.event("keep-job", EventKind.JOB_FINISHED, instance=view["instance"])
    assert r["state"] == "finished"
    after = await api.get("/v1/jobs/keep-job")
    assert after["data"].get("terminate", []) == []  # nothing queued for termination
    assert (await vm_alive(prov, vm)).state.value == "running"


async def test_instance_lost_while_restoring_is_a_failed_attempt(
    api_factory: Factory, tmp_path: Path
) -> None:
    marker = tmp_path / "lost-first"
    api, _, _ = await api_factory(env={"STANDIN_LOSE_FIRST": str(marker)}, liveness_s=0.1)
    view = await relaunched(api, "lost-job", tmp_path)
    lost_vm = marker.read_text()
    assert view["instance"]["instance_id"] != lost_vm  # the second VM restored the job
    assert view["restarts"] == 2
    gone = [h for h in view["history"] if f"instance {lost_vm} is terminated" in h["reason"]]
    assert [(h["from"], h["to"]) for h in gone] == [("restoring", "launching")]
    moves = [(h["from"], h["to"]) for h in view["history"] if h["from"] != h["to"]]
    assert moves == [
        (None, "protected"),
        ("protected", "launching"),
        ("launching", "restoring"),
        ("restoring", "launching"),
        ("launching", "restoring"),
        ("restoring", "protected"),
    ]


async def test_instance_lost_while_restoring_counts_against_max_restarts(
    api_factory: Factory, tmp_path: Path
) -> None:
    marker = tmp_path / "lost-once"
    api, _, _ = await api_factory(
        env={"STANDIN_LOSE_FIRST": str(marker)}, liveness_s=0.1, max_restarts=1
    )
    await api.event("lost-max", EventKind.STARTED, instance=VM1)
    image = f"file://{tmp_path}/store/lost-max/images/20261122T000000000000Z-abc123"
    await api.event("lost-max", EventKind.EXITED, instance=VM1, image_url=image)
    view = await api.wait_state("lost-max", "failed")
    assert view["reason"].startswith("max restarts (1) reached: 1 relaunch rounds in a row")
    assert any("is terminated before the job was restored" in h["reason"] for h in view["history"])


async def test_directive_tells_a_polling_agent_to_drain_for_a_migration(
    api_factory: Factory,
) -> None:
    api, _, _ = await api_factory()
    await api.event("dir-job", EventKind.STARTED, instance=VM1)
    d = await api.get("/v1/jobs/dir-job/directive")
    assert (d["_status"], d["action"], d["state"]) == (200, None, "protected")
    r = await api.migrate("dir-job", {"to": "local"})
    assert r["_status"] == 200
    d = await api.get("/v1/jobs/dir-job/directive")
    assert (d["job"], d["action"], d["reason"]) == ("dir-job", "drain", "migrate to local")
    assert d["target"] == {"region": "local"}  # the local region (also its one type)
    # The agent drains: its READY_TO_RELAUNCH starts the round; nothing more is asked of it.
    image = "file:///s/dir-job/images/20261122T000000000000Z-abc123"
    r = await api.event("dir-job", EventKind.READY_TO_RELAUNCH, instance=VM1, image_url=image)
    assert r["state"] == "launching"
    d = await api.get("/v1/jobs/dir-job/directive")
    assert d["action"] is None
    assert (await api.get("/v1/jobs/nope/directive"))["_status"] == 404
    async with api.s.get(api.url + "/v1/jobs/dir-job/directive") as resp:
        assert resp.status == 401


async def test_resumed_checkpoint_after_a_rebalance_never_relaunches(
    api_factory: Factory, tmp_path: Path
) -> None:
    api, _, _ = await api_factory(notice_grace_s=0.1)
    job = "rebalanced"
    await api.event(job, EventKind.STARTED, instance=VM1)
    deadline = (datetime.now(UTC) + timedelta(seconds=0.3)).isoformat()
    notice = {"id": "r1", "cloud": "aws", "kind": "rebalance", "deadline": deadline}
    r = await api.event(job, EventKind.NOTICE, instance=VM1, notice=notice, decision="resume")
    assert r["state"] == "interrupting"
    image = f"file://{tmp_path}/store/{job}/images/20261122T000000000000Z-abc123"
    r = await api.event(
        job, EventKind.DURABLE, instance=VM1, notice=notice, image_url=image, image_bytes=10,
        mode="resume",
    )  # fmt: skip
    assert r["state"] == "protected"
    view = await held_state(api, job, "protected", 1.0)  # well past deadline + grace
    assert view["image_url"] == image and view["restarts"] == 0
    assert not (tmp_path / "local" / "vms").exists() or not any(
        (tmp_path / "local" / "vms").iterdir()
    )
    # A rebalance the agent ignores (decision none) does not even interrupt.
    notice2 = {**notice, "id": "r2"}
    r = await api.event(job, EventKind.NOTICE, instance=VM1, notice=notice2, decision="none")
    assert r["state"] == "protected"
    r = await api.event(job, EventKind.JOB_FINISHED, instance=VM1)
    assert r["state"] == "finished"


async def test_preempt_with_a_resumed_checkpoint_relaunches_unless_the_agent_still_polls(
    api_factory: Factory, tmp_path: Path
) -> None:
    api, _, _ = await api_factory(notice_grace_s=0.5)
    image = f"file://{tmp_path}/store/p/images/20261122T000000000000Z-abc123"
    for job in ("polls", "silent"):
        await api.event(job, EventKind.STARTED, instance=VM1)
        deadline = (datetime.now(UTC) + timedelta(seconds=0.2)).isoformat()
        notice = {"id": f"p-{job}", "cloud": "aws", "kind": "preempt", "deadline": deadline}
        await api.event(job, EventKind.NOTICE, instance=VM1, notice=notice)
        r = await api.event(
            job, EventKind.DURABLE, instance=VM1, image_url=image.replace("/p/", f"/{job}/"),
            image_bytes=10, mode="resume",
        )  # fmt: skip
        assert r["state"] == "checkpointed"  # the VM goes away: a relaunch stays possible
    await asyncio.sleep(0.3)  # past the deadline, within the grace
    d = await api.get("/v1/jobs/polls/directive")  # the agent of "polls" is still there
    assert d["_status"] == 200
    await api.wait_state("polls", "protected", within=5)
    loop = asyncio.get_running_loop()
    end = loop.time() + 10
    while True:  # nobody heard from "silent" after the deadline: relaunched
        view = await api.get("/v1/jobs/silent")
        if any(h["to"] == "launching" for h in view["history"]):
            break
        assert loop.time() < end, view["state"]
        await asyncio.sleep(0.05)


async def test_each_relaunched_vm_gets_its_own_jobs_key_sources(
    api_factory: Factory, tmp_path: Path
) -> None:
    # the assignment a launched VM boots with names where that job's image keys are fetched
    # from: a job's own sources where it has them, the fleet's otherwise (issue 27 item 6)
    fleet_sign = "aws-secretsmanager:arn:aws:secretsmanager:r:1:secret:fleet"
    own_sign = "aws-secretsmanager:arn:aws:secretsmanager:r:1:secret:own"
    own_verify = "aws-ssm:arn:aws:ssm:r:1:parameter/own"
    api, _, _ = await api_factory(
        vm_signing_key_source=fleet_sign,
        vm_signing_key_sources={"own": own_sign},
        vm_verify_key_sources={"own": own_verify},
    )
    got = {}
    for job in ("own", "other"):
        view = await relaunched(api, job, tmp_path)
        vm = tmp_path / "local" / "vms" / view["instance"]["instance_id"]
        got[job] = json.loads((vm / "assignment.json").read_text())["keys"]
    assert got["own"] == {"signing_key": own_sign, "verify_key": own_verify}
    assert got["other"] == {"signing_key": fleet_sign, "verify_key": None}
