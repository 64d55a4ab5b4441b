"""End to end on one machine, with real parts only: a real job frozen by real CRIU, real
``spotguard agent`` processes, the metadata-sim injecting a spot notice, a file:// store,
and the controller relaunching the job on a local "VM 2" through the local provider.
The job's output must equal an uninterrupted run's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.image.settings import ImageSettings
from spotguard.providers.local import LocalProvider, LocalSettings
from spotguard.simulator import MetadataSim, SimFacts

pytestmark = pytest.mark.criu

TOKEN = "e2e-token"
SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))
JOB = [sys.executable, "-m", "spotguard.demo.job"]
JOB_ARGS = ["--steps", "120", "--step-seconds", "0.05", "--mb", "4", "--seed", "11", "--gpu", "no"]


@pytest.fixture(scope="module")
def reference() -> str:
    """What the job prints when nothing interrupts it."""
    return subprocess.run([*JOB, *JOB_ARGS], capture_output=True, text=True, check=True).stdout


@pytest.fixture
async def sims() -> AsyncIterator[tuple[MetadataSim, MetadataSim]]:
    """One metadata service per VM (VM 2 must not see VM 1's notice)."""
    async with (
        MetadataSim(facts=SimFacts(instance_id="i-0vm1vm1vm1vm1vm1")) as vm1,
        MetadataSim(facts=SimFacts(instance_id="i-0vm2vm2vm2vm2vm2")) as vm2,
    ):
        yield vm1, vm2


def agent_env(sim: MetadataSim, criu: str, shm: Path, **extra: str) -> dict[str, str]:
    return {
        **sim.env(),
        "SPOTGUARD_CRIU": criu,
        "SPOTGUARD_SHM_DIR": str(shm),
        "SPOTGUARD_NOTICES_CLOUD": "aws",
        "SPOTGUARD_NOTICES_POLL_INTERVAL": "0.2",
        "SPOTGUARD_API_LISTEN": "127.0.0.1:0",
        **extra,
    }


async def job_view(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(url + "/v1/jobs/train", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        out: dict[str, Any] = await r.json()
        return out


async def wait_for(s: aiohttp.ClientSession, url: str, state: str, within: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        v = await job_view(s, url)
        if v.get("state") == state:
            return v
        assert loop.time() < end, f"job is {v.get('state')}: {v.get('reason')}"
        await asyncio.sleep(0.1)


@dataclass
class Stack:
    """A running controller (local provider), VM 1's agent protecting the job, a file store."""

    tmp: Path
    store: str
    url: str
    http: aiohttp.ClientSession
    job: JobInfo
    sim1: MetadataSim

    @property
    def vms(self) -> Path:
        return self.tmp / "local" / "vms"


@contextlib.asynccontextmanager
async def stack(
    criu_bin: str,
    tmp_path: Path,
    sims: tuple[MetadataSim, MetadataSim],
    job_args: list[str] = JOB_ARGS,
    **controller: Any,
) -> AsyncIterator[Stack]:
    """Start the job and VM 1's real agent under a real controller; on exit stop every agent,
    VM and job it started, whatever happened."""
    sim1, sim2 = sims
    store = f"file://{tmp_path}/store"
    shm = Path("/dev/shm") / f"spotguard-e2e-{uuid.uuid4().hex[:8]}"
    vm1 = tmp_path / "vm1"
    local = LocalProvider(
        LocalSettings(
            local_root=tmp_path / "local",
            local_agent_command=[SPOTGUARD, "agent", "--exit-when-done"],
            local_env=agent_env(sim2, criu_bin, shm / "vm2", SPOTGUARD_STORE=store),
            local_gpus=False,
        )
    )
    settings = ControllerSettings(
        listen="127.0.0.1:0",
        state=tmp_path / "controller.db",
        controller_token=TOKEN,
        tick_s=0.1,
        **controller,
    )
    job = await start_job([*JOB, *job_args], "train", state_dir=vm1 / "state")
    agent1: asyncio.subprocess.Process | None = None
    try:
        async with (
            ControllerServer(
                settings, provider=local, image=ImageSettings.model_validate({})
            ) as srv,
            aiohttp.ClientSession() as s,
        ):
            env = {
                **os.environ,
                **agent_env(sim1, criu_bin, shm / "vm1"),
                "SPOTGUARD_STATE_DIR": str(vm1 / "state"),
                "SPOTGUARD_ASSIGNMENT": str(vm1 / "no-assignment.json"),
                "SPOTGUARD_CONTROLLER_URL": srv.url,
                "SPOTGUARD_CONTROLLER_TOKEN": TOKEN,
            }
            with (vm1 / "agent.log").open("ab") as log:
                agent1 = await asyncio.create_subprocess_exec(
                    *[SPOTGUARD, "agent", "--job", "train", "--store", store],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            await wait_for(s, srv.url, "protected", 30)
            yield Stack(tmp_path, store, srv.url, s, job, sim1)
    finally:
        if agent1 is not None and agent1.returncode is None:
            os.killpg(agent1.pid, signal.SIGTERM)
            await asyncio.wait_for(agent1.wait(), 30)
        for vm in (tmp_path / "local" / "vms").glob("vm-*"):
            vm_json = json.loads((vm / "vm.json").read_text())
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(vm_json["pid"]), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.pid, signal.SIGKILL)
        shutil.rmtree(shm, ignore_errors=True)


async def test_spot_notice_on_vm1_job_continues_on_vm2_with_identical_output(
    criu_bin: str, tmp_path: Path, sims: tuple[MetadataSim, MetadataSim], reference: str
) -> None:
    async with stack(criu_bin, tmp_path, sims, restore_timeout_s=120) as st:
        st.sim1.state.send("aws", "preempt", in_seconds=120)
        v = await wait_for(st.http, st.url, "finished", 120)
        moves = [h["to"] for h in v["history"] if h["from"] != h["to"]]
        assert moves == [
            "protected",
            "interrupting",
            "checkpointed",
            "launching",
            "restoring",
            "protected",
            "finished",
        ], v["history"]
        assert v["instance"]["instance_id"] == "i-0vm2vm2vm2vm2vm2"
        assert v["image_url"].startswith(f"{st.store}/train/images/")
        vm2 = next(st.vms.iterdir())
        restored = json.loads((vm2 / "state" / "jobs" / "train" / "job.json").read_text())
        out_dir = Path(restored.get("dir", vm2 / "state" / "jobs" / "train"))
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while not (out_dir / "exit_status").exists():
            assert loop.time() < end, "the restored job did not finish"
            await asyncio.sleep(0.1)
        assert (out_dir / "stdout").read_text() == reference


async def test_rebalance_checkpoint_resumes_on_vm1_and_is_never_relaunched(
    criu_bin: str, tmp_path: Path, sims: tuple[MetadataSim, MetadataSim], reference: str
) -> None:
    """A real agent checkpoints on a rebalance and lets the job run on (resume mode); its
    DURABLE says so and the controller returns the job to PROTECTED: with no grace at all,
    no second VM starts and the job finishes on VM 1."""
    async with stack(criu_bin, tmp_path, sims, notice_grace_s=0.0) as st:
        st.sim1.state.send("aws", "rebalance")
        v = await wait_for(st.http, st.url, "finished", 60)
        moves = [h["to"] for h in v["history"] if h["from"] != h["to"]]
        assert moves == ["protected", "interrupting", "protected", "finished"], v["history"]
        assert v["image_url"].startswith(f"{st.store}/train/images/")
        assert v["instance"]["instance_id"] == "i-0vm1vm1vm1vm1vm1" and v["restarts"] == 0
        assert not st.vms.exists() or not any(st.vms.iterdir()), "a second VM was started"
        assert (st.job.dir / "stdout").read_text() == reference


async def _spotguard(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        SPOTGUARD, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()


async def test_job_parked_to_the_store_on_vm1_is_unparked_on_vm2_with_identical_output(
    criu_bin: str, tmp_path: Path, sims: tuple[MetadataSim, MetadataSim]
) -> None:
    """``spotguard park --to URL`` on VM 1 (the command itself not told of any controller):
    VM 1's agent reports the job parked, not finished; ``spotguard jobs unpark`` relaunches it
    on VM 2, whose real agent restores the parked image; the output equals an uninterrupted
    run's."""
    args = ["--steps", "200", "--step-seconds", "0.05", "--mb", "4", "--seed", "5", "--gpu", "no"]
    fast = [*args[:2], *args[4:]]  # the output does not depend on the pace
    ref = await asyncio.create_subprocess_exec(
        *JOB, *fast, "--step-seconds", "0", stdout=asyncio.subprocess.PIPE
    )
    async with stack(criu_bin, tmp_path, sims, job_args=args, restore_timeout_s=120) as st:
        vm1 = st.tmp / "vm1"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")},
            "SPOTGUARD_STATE_DIR": str(vm1 / "state"),
            "SPOTGUARD_CRIU": criu_bin,
            "SPOTGUARD_SHM_DIR": str(vm1 / "shm"),
        }
        rc, out, err = await _spotguard(
            env, "park", "train", "--to", st.store, "--reason", "idle notebook", "--json"
        )
        assert rc == 0, err
        parked = json.loads(out)
        assert parked["place"] == "store" and "controller" not in parked
        v = await wait_for(st.http, st.url, "parked", 30)
        assert v["image_url"] == parked["where"]
        assert v["reason"] == f"parked to {parked['where']} on i-0vm1vm1vm1vm1vm1 (idle notebook)"
        await asyncio.sleep(1.5)  # VM 1's agent has long seen the process gone by now
        assert (await job_view(st.http, st.url))["state"] == "parked"

        admin = {**env, "SPOTGUARD_CONTROLLER_URL": st.url, "SPOTGUARD_CONTROLLER_TOKEN": TOKEN}
        rc, out, err = await _spotguard(admin, "jobs", "unpark", "train")
        assert rc == 0, err
        assert out.startswith("train: launching — unpark from the parked image file://")
        v = await wait_for(st.http, st.url, "finished", 120)
        moves = [h["to"] for h in v["history"] if h["from"] != h["to"]]
        assert moves == ["protected", "parked", "launching", "restoring", "protected", "finished"]
        assert v["instance"]["instance_id"] == "i-0vm2vm2vm2vm2vm2"
        vm2 = next(st.vms.iterdir())
        restored = json.loads((vm2 / "state" / "jobs" / "train" / "job.json").read_text())
        out_dir = Path(restored.get("dir", vm2 / "state" / "jobs" / "train"))
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while not (out_dir / "exit_status").exists():
            assert loop.time() < end, "the restored job did not finish"
            await asyncio.sleep(0.1)
        reference, _ = await ref.communicate()
        assert (out_dir / "stdout").read_text() == reference.decode()
