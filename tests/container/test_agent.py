"""A container protected by the agent, through the controller's relaunch (issue 29), with real
parts only — the scenario of ``spotguard demo --container`` (one run covers both): real
podman, runc and CRIU, two podman storages as two VMs, VM 1's real ``spotguard agent --job
podman:counter``, a metadata emulator per VM, a file:// store, the controller relaunching the
job on a local "VM 2" whose agent restores it from the assignment as a new container of the
same image, name and bind mount. Between the demo's steps the test looks at what the agent
says: its status and ledger, a rebalance's leave-running checkpoint (podman restores the
container in place under a new init process, which the agent must follow), and VM 1 after
the relaunch. The counter goes on without a gap or a repeat."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from sgtest import line_count, without_spotguard_settings
from spotguard.container.demo import IMAGE, Stage, run_container_demo
from spotguard.container.podman import Podman
from spotguard.container.settings import PREFIX
from spotguard.image.settings import ImageSettings

SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))


async def _status(stage: Stage) -> dict[str, Any]:
    token = (stage.state_dir / "agent" / "api.token").read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    async with stage.http.get(f"{stage.api}/status", headers=headers) as r:
        [job] = (await r.json())["jobs"]
        out: dict[str, Any] = job
        return out


async def _protected_on_vm1(stage: Stage) -> None:
    mine = await _status(stage)
    assert (mine["job"], mine["container"], mine["state"]) == (
        "podman-counter", "podman:counter", "protecting"
    )  # fmt: skip
    pid = mine["pid"]
    assert pid > 0 and mine["cannot_checkpoint"] == []
    # a rebalance: leave-running (podman restores the container in place: a new init process)
    stage.sim1.state.send("aws", "rebalance")
    loop = asyncio.get_running_loop()
    end = loop.time() + 60
    while mine["checkpoints"] < 1 or mine["state"] != "protecting":
        assert loop.time() < end and mine["state"] != "finished", mine
        await asyncio.sleep(0.1)
        mine = await _status(stage)
    assert mine["last_image"]["mode"] == "resume" and mine["pid"] != pid, mine
    n = line_count(stage.data / "out")
    await asyncio.sleep(1.2)  # longer than the agent's liveness look (1 s)
    mine = await _status(stage)
    assert mine["state"] == "protecting" and line_count(stage.data / "out") > n, mine
    ledger = json.loads((stage.state_dir / "agent/jobs/podman-counter.json").read_text())
    assert (ledger["state"], ledger["pid"]) == ("protecting", mine["pid"])


async def _relaunched_on_vm2(stage: Stage) -> None:
    v = await stage.job()
    assert v["instance"]["instance_id"] == "i-0demovm2demovm2", v
    image = v["image_url"]
    # VM 1: the container is gone (exit mode); the ledger and the status say why
    assert not await stage.vm1.exists("container", "counter")
    ledger = json.loads((stage.state_dir / "agent/jobs/podman-counter.json").read_text())
    assert (ledger["state"], ledger["image_url"]) == ("exited", image)
    mine = await _status(stage)
    assert (mine["state"], mine["last_image"]["url"]) == ("exited", image)
    # VM 2: a new container of the same name, image and bind mount
    back = await stage.vm2.inspect("counter")
    assert back is not None and back["ImageName"] == IMAGE
    assert [m["Source"] for m in back["Mounts"]] == [str(stage.data)]


async def test_a_notice_checkpoints_the_container_and_the_controller_restores_it_on_vm2(
    podman_bin: str, criu_bin: str, tmp_path: Path
) -> None:
    podman = Podman(podman_bin, str(PREFIX / "bin" / "runc"), criu_bin, timeout=120)
    result = await run_container_demo(
        podman, ImageSettings.model_validate({}), tmp_path, lambda _: None,
        protected=_protected_on_vm1, relaunched=_relaunched_on_vm2,
    )  # fmt: skip
    assert result.ok, result
    assert result.history == [
        "protected", "interrupting", "protected",  # the rebalance: resumed
        "interrupting", "checkpointed", "launching", "restoring", "protected", "finished",
    ]  # fmt: skip


def test_the_agent_refuses_a_container_it_cannot_address_in_one_line(
    tmp_path: Path,
) -> None:
    out = subprocess.run(
        [SPOTGUARD, "agent", "--job", "containerd:k8s.io/a..b", "--store", f"file://{tmp_path}/s"],
        env=without_spotguard_settings(SPOTGUARD_STATE_DIR=str(tmp_path / "state")),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "invalid containerd container ID 'a..b'" in out.stderr, out.stderr
