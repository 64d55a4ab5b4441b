"""Fencing and scoped credentials over real HTTP, with the local provider's VMs running the
stand-in agent: each job has an owner (instance + epoch); a VM token acts for its job only and
only while its epoch owns it; the admin token never reaches a VM; an image that can never
restore falls back to the newest older complete image instead of a third VM."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path
from typing import Any

import psutil
import pytest
from controller_helpers import TOKEN, Api, Factory

from spotguard.contracts import Assignment, EventKind, make_event
from spotguard.controller.tokens import TokenKeys
from spotguard.facts import HostFacts
from spotguard.image import ImageSettings, push_dir

GIB = 1024**3


async def post(api: Api, token: str, job: str, kind: EventKind, **kw: Any) -> dict[str, Any]:
    ev = make_event(kind, job=job, **kw)
    return await api.post_raw(ev.model_dump_json(), token=token)


async def get(api: Api, path: str, token: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"}
    async with api.s.get(api.url + path, headers=headers) as r:
        out: dict[str, Any] = await r.json()
        out["_status"] = r.status
        return out


def vm_pid(vm_dir: Path) -> int:
    return int(json.loads((vm_dir / "vm.json").read_text())["pid"])


async def write_image(tmp_path: Path, job: str, n: int) -> str:
    src = tmp_path / f"img-{job}-{n}"
    src.mkdir()
    (src / "pages-1.img").write_bytes(bytes([n]) * 4096)
    meta = {"host": HostFacts("6.1.0", "x86_64", 4 * GIB, "4.1.1").to_json()}
    return (
        await push_dir(src, f"file://{tmp_path}/store", job, meta, settings=ImageSettings())
    ).image_url


async def relaunched(api: Api, tmp_path: Path, job: str, image: str, old_token: str) -> str:
    """Protect ``job`` on VM1 with ``old_token``, preempt it, exit with ``image``: the
    controller launches a local VM whose stand-in restores it. Returns the new VM's id."""
    vm1 = {"provider": "local", "instance_id": "vm1"}
    assert (await post(api, old_token, job, EventKind.STARTED, instance=vm1))["_status"] == 200
    notice = {"id": "n1", "cloud": "aws", "kind": "preempt"}
    await post(api, old_token, job, EventKind.NOTICE, instance=vm1, notice=notice)
    await post(api, old_token, job, EventKind.DURABLE, instance=vm1, image_url=image)
    await post(api, old_token, job, EventKind.EXITED, instance=vm1, image_url=image)
    view = await api.wait_state(job, "protected", within=30)
    return str(view["instance"]["instance_id"])


async def test_old_vms_agent_restarting_after_its_exit_cannot_finish_the_moved_job(
    api_factory: Factory, tmp_path: Path
) -> None:
    """The old VM's agent restarts after its exit checkpoint, reads the dead PID as "finished
    by itself" and reports job_finished: the controller records and ignores it, answers
    stand_down, and leaves the new VM running — with a VM token and with the fleet token."""
    api, _, _ = await api_factory()
    keys = TokenKeys(TOKEN)
    old = keys.issue("train", 0)
    image = await write_image(tmp_path, "train", 1)
    vm2 = await relaunched(api, tmp_path, "train", image, old)
    vm_dir = tmp_path / "local" / "vms" / vm2

    # 1. the old agent holds the job's epoch-0 VM token
    r = await post(
        api,
        old,
        "train",
        EventKind.JOB_FINISHED,
        instance={"provider": "local", "instance_id": "vm1"},
    )
    assert r["_status"] == 409 and r["stale"] is True and r["stand_down"] is True
    assert r["owner"]["epoch"] == 1 and "not the job's owner" in r["error"]
    # 2. an agent with the fleet token and no epoch names its (old) instance
    r = await post(
        api,
        TOKEN,
        "train",
        EventKind.JOB_FINISHED,
        instance={"provider": "local", "instance_id": "vm1"},
    )
    assert r["_status"] == 409 and r["stand_down"] is True
    await asyncio.sleep(0.5)  # several reconcile ticks
    view = await api.get("/v1/jobs/train")
    assert view["state"] == "protected", view["reason"]
    assert psutil.pid_exists(vm_pid(vm_dir)), "the new VM was terminated"
    assert any("non-owner" in h["reason"] for h in view["history"])
    # the old token's directive says stand down; the new VM's token acts normally
    d = await get(api, "/v1/jobs/train/directive", old)
    assert d["_status"] == 200 and d["stand_down"] is True and d["owner"]["epoch"] == 1
    new = Assignment.model_validate_json((vm_dir / "assignment.json").read_text())
    d = await get(api, "/v1/jobs/train/directive", str(new.controller_token))
    assert d["stand_down"] is False
    r = await post(
        api,
        str(new.controller_token),
        "train",
        EventKind.JOB_FINISHED,
        instance={"provider": "local"},
    )
    assert r["_status"] == 200 and r["state"] == "finished"


async def test_vm_token_acts_for_its_job_only_and_admin_token_never_reaches_the_vm(
    api_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTGUARD_CONTROLLER_TOKEN", TOKEN)  # the controller's own env
    api, _, _ = await api_factory()
    keys = TokenKeys(TOKEN)
    image = await write_image(tmp_path, "alpha", 1)
    vm2 = await relaunched(api, tmp_path, "alpha", image, keys.issue("alpha", 0))
    vm_dir = tmp_path / "local" / "vms" / vm2
    for name in ("assignment.json", "user-data"):
        path = vm_dir / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
        assert TOKEN not in path.read_text(), f"the admin token is in {name}"
    a = Assignment.model_validate_json((vm_dir / "assignment.json").read_text())
    assert a.epoch == 1 and a.controller_token == keys.issue("alpha", 1)
    env = psutil.Process(vm_pid(vm_dir)).environ()
    assert TOKEN not in env.values() and env["SPOTGUARD_CONTROLLER_TOKEN"] == a.controller_token

    vm_token = str(a.controller_token)
    other = await post(api, vm_token, "beta", EventKind.STARTED)  # another job: refused
    assert other["_status"] == 403 and "beta" in other["error"]
    assert (await get(api, "/v1/jobs/beta/directive", vm_token))["_status"] == 403
    assert (await get(api, "/v1/jobs", vm_token))["_status"] == 403  # admin routes
    assert (await get(api, "/v1/jobs/alpha", vm_token))["_status"] == 403
    mig = await api.s.post(
        api.url + "/v1/jobs/alpha/migrate",
        json={"to": "local"},
        headers={"Authorization": f"Bearer {vm_token}"},
    )
    assert mig.status == 403
    lying = make_event(EventKind.STARTED, job="alpha", epoch=0)  # claims an older epoch
    r = await api.post_raw(lying.model_dump_json(), token=vm_token)
    assert r["_status"] == 403
    forged = vm_token[:-4] + ("AAAA" if not vm_token.endswith("AAAA") else "BBBB")
    assert (await post(api, forged, "alpha", EventKind.STARTED))["_status"] == 401
    assert (await api.get("/v1/jobs/beta"))["_status"] == 404  # nothing was created
    # the job's own token works while it owns the job
    ok = await post(api, vm_token, "alpha", EventKind.STARTED, instance={"provider": "local"})
    assert ok["_status"] == 200 and ok["stand_down"] is False


async def test_corrupt_image_falls_back_to_the_newest_older_image(
    api_factory: Factory, tmp_path: Path
) -> None:
    older = await write_image(tmp_path, "train", 1)
    newer = await write_image(tmp_path, "train", 2)
    assert older < newer
    api, _, _ = await api_factory(
        env={"STANDIN_FAIL": "ImageCorrupt", "STANDIN_FAIL_IMAGE": newer}, max_restarts=5
    )
    await relaunched(api, tmp_path, "train", newer, TOKEN)
    view = await api.get("/v1/jobs/train")
    assert view["image_url"] == older
    assert view["restarts"] == 2  # one VM for the corrupt image, one for the older: not three
    assert len(list((tmp_path / "local" / "vms").iterdir())) == 2
    reasons = [h["reason"] for h in view["history"]]
    assert any(f"image {newer} cannot be restored" in r for r in reasons)
    assert any(f"falling back to the older image {older}" in r for r in reasons)


async def test_corrupt_image_without_an_older_one_fails_saying_so(
    api_factory: Factory, tmp_path: Path
) -> None:
    only = await write_image(tmp_path, "solo", 1)
    api, _, _ = await api_factory(env={"STANDIN_FAIL": "ImageCorrupt"}, max_restarts=5)
    vm1 = {"provider": "local", "instance_id": "vm1"}
    await post(api, TOKEN, "solo", EventKind.STARTED, instance=vm1)
    await post(api, TOKEN, "solo", EventKind.EXITED, instance=vm1, image_url=only)
    view = await api.wait_state("solo", "failed", within=30)
    assert "no older complete image" in view["reason"]
    assert view["restarts"] == 1
    assert len(list((tmp_path / "local" / "vms").iterdir())) == 1
