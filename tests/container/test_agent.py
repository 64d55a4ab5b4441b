"""A container protected by the agent, through the controller's relaunch (issue 29), with real
parts only: real podman, runc and CRIU; VM 1's real ``spotguard agent --job podman:ctr``; a
spot notice from the metadata emulator; a file:// store; the controller relaunching the job
on a local "VM 2" (its own podman storage) whose agent restores it from the assignment as a
new container of the same image, name and bind mount. The container counts on without a gap
or a repeat, and the controller, the agent's status and its ledger say what happened."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
from podman_helpers import IMAGE, Vm

from sgtest import free_port, line_count, without_spotguard_settings
from spotguard.container import ContainerRef
from spotguard.container.demo import vm_env
from spotguard.container.start import start_container
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.image.settings import ImageSettings
from spotguard.providers.local import LocalProvider, LocalSettings
from spotguard.simulator import MetadataSim, SimFacts

TOKEN = "ctr-e2e-token"
SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))
#: counts until told to stop (a file in its bind mount): still running whenever it is looked at
JOB = "exec >>/data/out; i=0; while [ ! -e /data/stop ]; do echo $i; i=$((i+1)); sleep 0.05; done"


def _vm_env(vm: Vm, sim: MetadataSim) -> dict[str, str]:
    """What points an agent at one VM: its podman storage, CRIU and metadata service."""
    return {
        **sim.env(),
        **vm_env(vm.podman),
        "SPOTGUARD_NOTICES_CLOUD": "aws",
        "SPOTGUARD_NOTICES_POLL_INTERVAL": "0.2",
        "SPOTGUARD_API_LISTEN": "127.0.0.1:0",
    }


async def _job(http: aiohttp.ClientSession, url: str, job: str) -> dict[str, Any]:
    async with http.get(f"{url}/v1/jobs/{job}", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        out: dict[str, Any] = await r.json()
        return out


async def _wait_state(
    http: aiohttp.ClientSession, url: str, job: str, state: str, within: float, restarts: int = 0
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        v = await _job(http, url, job)
        if v.get("state") == state and v.get("restarts", 0) >= restarts:
            return v
        assert loop.time() < end, f"{job} is {v.get('state')}: {v.get('reason')}"
        await asyncio.sleep(0.1)


async def _status(http: aiohttp.ClientSession, port: int, state_dir: Path) -> dict[str, Any]:
    token = (state_dir / "agent" / "api.token").read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    async with http.get(f"http://127.0.0.1:{port}/status", headers=headers) as r:
        out: dict[str, Any] = await r.json()
        return out


async def test_a_notice_checkpoints_the_container_and_the_controller_restores_it_on_vm2(
    vms: tuple[Vm, Vm],
) -> None:
    vm1, vm2 = vms
    base = vm1.state_dir.parent.parent
    data = base / "data"
    data.mkdir()
    out = data / "out"
    store = f"file://{base / 'store'}"
    ref = ContainerRef.parse("podman:ctr")
    await start_container(
        ref, IMAGE, ["/bin/sh", "-c", JOB], podman=vm1.podman, volumes=[f"{data}:/data"]
    )
    port = free_port()
    async with (
        MetadataSim(facts=SimFacts(instance_id="i-0ctrvm1ctrvm1ctr")) as sim1,
        MetadataSim(facts=SimFacts(instance_id="i-0ctrvm2ctrvm2ctr")) as sim2,
    ):
        local = LocalProvider(
            LocalSettings(
                local_root=base / "local",
                local_agent_command=[SPOTGUARD, "agent", "--exit-when-done"],
                local_env={**_vm_env(vm2, sim2), "SPOTGUARD_STORE": store},
                local_gpus=False,
            )
        )
        settings = ControllerSettings(
            listen="127.0.0.1:0", state=base / "controller.db", controller_token=TOKEN,
            tick_s=0.1, restore_timeout_s=120, notice_grace_s=0.0,
        )  # fmt: skip
        agent1: asyncio.subprocess.Process | None = None
        try:
            async with (
                ControllerServer(settings, provider=local, image=ImageSettings()) as srv,
                aiohttp.ClientSession() as http,
            ):
                env = without_spotguard_settings(
                    **{**_vm_env(vm1, sim1), "SPOTGUARD_API_LISTEN": f"127.0.0.1:{port}"},
                    SPOTGUARD_STATE_DIR=str(vm1.state_dir),
                    SPOTGUARD_ASSIGNMENT=str(base / "no-assignment.json"),
                    SPOTGUARD_CONTROLLER_URL=srv.url,
                    SPOTGUARD_CONTROLLER_TOKEN=TOKEN,
                )
                with (base / "agent1.log").open("ab") as log:
                    agent1 = await asyncio.create_subprocess_exec(
                        SPOTGUARD, "agent", "--job", "podman:ctr", "--store", store,
                        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    )  # fmt: skip
                v = await _wait_state(http, srv.url, ref.job, "protected", 60)
                assert v["instance"]["instance_id"] == "i-0ctrvm1ctrvm1ctr"
                status = await _status(http, port, vm1.state_dir)
                [mine] = status["jobs"]
                assert (mine["job"], mine["container"], mine["state"]) == (
                    "podman-ctr", "podman:ctr", "protecting"
                )  # fmt: skip
                pid = mine["pid"]
                assert pid > 0 and mine["cannot_checkpoint"] == []
                # a rebalance: leave-running (podman restores it in place, a new init process)
                sim1.state.send("aws", "rebalance")
                loop = asyncio.get_running_loop()
                end = loop.time() + 60
                while mine["checkpoints"] < 1 or mine["state"] != "protecting":
                    assert loop.time() < end and mine["state"] != "finished", mine
                    await asyncio.sleep(0.1)
                    [mine] = (await _status(http, port, vm1.state_dir))["jobs"]
                assert mine["last_image"]["mode"] == "resume" and mine["pid"] != pid, mine
                n = line_count(out)
                await asyncio.sleep(1.5)  # the agent's liveness look (1 s) follows the new pid
                [mine] = (await _status(http, port, vm1.state_dir))["jobs"]
                assert mine["state"] == "protecting" and line_count(out) > n, mine

                sim1.state.send("aws", "preempt", in_seconds=120)
                v = await _wait_state(http, srv.url, ref.job, "protected", 120, restarts=1)
                assert v["instance"]["instance_id"] == "i-0ctrvm2ctrvm2ctr", v
                image = v["image_url"]
                assert image.startswith(f"{store}/podman-ctr/images/")
                # VM 1: the container is gone (exit mode), the ledger and status say why
                assert not await vm1.podman.exists("container", "ctr")
                ledger = json.loads((vm1.state_dir / "agent/jobs/podman-ctr.json").read_text())
                assert (ledger["state"], ledger["image_url"]) == ("exited", image)
                [mine] = (await _status(http, port, vm1.state_dir))["jobs"]
                assert (mine["state"], mine["last_image"]["url"]) == ("exited", image)
                # VM 2: a new container of the same name, image and bind mount, running on
                back = await vm2.podman.inspect("ctr")
                assert back is not None and back["ImageName"] == IMAGE
                assert [m["Source"] for m in back["Mounts"]] == [str(data)]
                n = line_count(out)
                end = loop.time() + 30
                while line_count(out) < n + 5:
                    assert loop.time() < end, "the restored container does not count on"
                    await asyncio.sleep(0.05)
                (data / "stop").touch()
                v = await _wait_state(http, srv.url, ref.job, "finished", 60)
                moves = [h["to"] for h in v["history"] if h["from"] != h["to"]]
                assert moves == [
                    "protected", "interrupting", "protected",  # the rebalance: resumed
                    "interrupting", "checkpointed", "launching", "restoring", "protected",
                    "finished",
                ], v["history"]  # fmt: skip
        finally:
            if agent1 is not None and agent1.returncode is None:
                os.killpg(agent1.pid, signal.SIGTERM)
                await asyncio.wait_for(agent1.wait(), 30)
            for vm in (base / "local" / "vms").glob("vm-*"):
                with contextlib.suppress(OSError, ValueError, ProcessLookupError):
                    os.killpg(int(json.loads((vm / "vm.json").read_text())["pid"]), signal.SIGKILL)
    text = out.read_text()
    assert text == "".join(f"{i}\n" for i in range(text.count("\n")))


def test_the_agent_refuses_a_container_runtime_it_does_not_drive_in_one_line(
    tmp_path: Path,
) -> None:
    out = subprocess.run(
        [SPOTGUARD, "agent", "--job", "docker:web", "--store", f"file://{tmp_path}/s"],
        env=without_spotguard_settings(SPOTGUARD_STATE_DIR=str(tmp_path / "state")),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "docker containers are not supported yet" in out.stderr, out.stderr
