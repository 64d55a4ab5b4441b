"""A run whose NCCL ranks span two VMs, end to end with real parts only: two ``spotguard run
--nccl-group`` jobs (ranks 0-2 on VM A, rank 3 on VM B, the fake NCCL), a real ``spotguard
agent`` on each VM, a real controller with the local provider, the metadata emulator.

A spot notice reaches VM A only. Its agent opens the group's freeze at the controller; VM B's
agent sees it and drains its job too; the two agents level and release the communicators that
span them through the controller, both jobs exit with their images, the controller relaunches
each on a new VM, and the two new agents restore them and meet at the controller again to
rebuild the communicators. The run's output equals an uninterrupted run's."""

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
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from ckpt_helpers import lines, wait_for

from conftest import Built
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.groupwire import GROUP_ENV
from spotguard.image.settings import ImageSettings
from spotguard.providers.local import LocalProvider, LocalSettings
from spotguard.simulator import MetadataSim, SimFacts

pytestmark = pytest.mark.criu

TOKEN = "group-e2e-token"
SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))
RANKS, STEPS, STEP_MS = 4, 400, 20


def _agent_env(sim: MetadataSim, criu: str, shm: Path, **extra: str) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")},
        **sim.env(),
        "SPOTGUARD_CRIU": criu,
        "SPOTGUARD_SHM_DIR": str(shm),
        "SPOTGUARD_NOTICES_CLOUD": "aws",
        "SPOTGUARD_NOTICES_POLL_INTERVAL": "0.2",
        "SPOTGUARD_API_LISTEN": "127.0.0.1:0",
        **extra,
    }


async def _view(s: aiohttp.ClientSession, url: str, job: str) -> dict[str, Any]:
    async with s.get(f"{url}/v1/jobs/{job}", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        out: dict[str, Any] = await r.json()
        return out


async def _state(s: aiohttp.ClientSession, url: str, job: str, want: str, within: float) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while (v := await _view(s, url, job)).get("state") != want:
        assert loop.time() < end, f"job {job} is {v.get('state')}: {v.get('reason')}"
        await asyncio.sleep(0.1)


def _logs(root: Path) -> str:
    """Every agent's log under ``root`` (the first VMs' and the relaunched ones')."""
    return "".join(p.read_text(errors="replace") for p in root.rglob("*.log"))


@pytest.fixture
async def sims() -> AsyncIterator[tuple[MetadataSim, ...]]:
    """One metadata service per first VM, one for the relaunched VMs."""
    async with (
        MetadataSim(facts=SimFacts(instance_id="i-0vmavmavmavmavma")) as a,
        MetadataSim(facts=SimFacts(instance_id="i-0vmbvmbvmbvmbvmb")) as b,
        MetadataSim(facts=SimFacts(instance_id="i-0newnewnewnewnew")) as new,
    ):
        yield a, b, new


async def test_a_notice_on_one_vm_moves_the_whole_run_and_it_ends_byte_identical(
    built: Built, criu_bin: str, tmp_path: Path, sims: tuple[MetadataSim, ...]
) -> None:
    sim_a, sim_b, sim_new = sims
    ref = tmp_path / "ref"
    ref.mkdir()
    done = await asyncio.create_subprocess_exec(
        str(built.job), str(RANKS), str(STEPS), "0", env=built.env(ref),
        stdout=asyncio.subprocess.PIPE)  # fmt: skip
    want = (await done.communicate())[0].decode().splitlines()

    store = f"file://{tmp_path}/store"
    shm = Path("/dev/shm") / f"spotguard-group-{uuid.uuid4().hex[:8]}"
    world = tmp_path / "world"
    world.mkdir()
    env = built.env(tmp_path, NCCL_JOB_ID=str(world), **{GROUP_ENV: "trainer"})
    local = LocalProvider(
        LocalSettings(
            local_root=tmp_path / "local",
            local_agent_command=[SPOTGUARD, "agent", "--exit-when-done"],
            local_env=_agent_env(sim_new, criu_bin, shm / "new", SPOTGUARD_STORE=store),
            local_gpus=False,
        )
    )
    settings = ControllerSettings(
        listen="127.0.0.1:0", state=tmp_path / "controller.db", controller_token=TOKEN,
        tick_s=0.1, restore_timeout_s=120,
    )  # fmt: skip
    steps = [str(STEPS), str(STEP_MS)]
    jobs: dict[str, JobInfo] = {}
    agents: list[asyncio.subprocess.Process] = []
    try:
        for vm, flag in (("a", "--skip-rank"), ("b", "--only-rank")):
            jobs[vm] = await start_job([str(built.job), str(RANKS), *steps, flag, "3"], vm,
                                       state_dir=tmp_path / f"vm-{vm}" / "state", env=env,
                                       nccl_shim=built.shim)  # fmt: skip
        async with (
            ControllerServer(settings, provider=local,
                             image=ImageSettings.model_validate({})) as srv,
            aiohttp.ClientSession() as http,
        ):  # fmt: skip
            for vm, sim in (("a", sim_a), ("b", sim_b)):
                root = tmp_path / f"vm-{vm}"
                agent_env = _agent_env(
                    sim, criu_bin, shm / vm, SPOTGUARD_STATE_DIR=str(root / "state"),
                    SPOTGUARD_ASSIGNMENT=str(root / "no-assignment.json"),
                    SPOTGUARD_CONTROLLER_URL=srv.url, SPOTGUARD_CONTROLLER_TOKEN=TOKEN,
                )  # fmt: skip
                with (root / "agent.log").open("ab") as log:
                    agents.append(await asyncio.create_subprocess_exec(
                        SPOTGUARD, "agent", "--job", vm, "--store", store, env=agent_env,
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
            for vm in jobs:
                await _state(http, srv.url, vm, "protected", 30)
            a_out = jobs["a"].dir / "stdout"
            await wait_for(lambda: len(lines(a_out)) > 20, "the run's first steps")

            sim_a.state.send("aws", "preempt", in_seconds=120)  # VM A only
            for vm in jobs:
                await _state(http, srv.url, vm, "finished", 180)

            vms = sorted((tmp_path / "local" / "vms").glob("vm-*"))
            assert len(vms) == 2, vms  # each job relaunched on a VM of its own
            out_dir = None
            for vm_dir in vms:
                rec = vm_dir / "state" / "jobs" / "a" / "job.json"
                if rec.exists():
                    out_dir = Path(json.loads(rec.read_text()).get("dir", rec.parent))
            assert out_dir is not None, "job a was not restored on a new VM"
            await wait_for(lambda: (out_dir / "exit_status").exists(), "the run to end", 60)
            assert (out_dir / "exit_status").read_text().strip() == "0"
            assert lines(out_dir / "stdout") == want
            logs = _logs(tmp_path)
            assert "another member of the NCCL group freezes" in logs
            assert logs.count("NCCL group rebuild met") >= 2
    finally:
        for proc in agents:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 30)
        for vm in (tmp_path / "local" / "vms").glob("vm-*"):
            with contextlib.suppress(OSError, ValueError, ProcessLookupError):
                os.killpg(int(json.loads((vm / "vm.json").read_text())["pid"]), signal.SIGKILL)
        for job in jobs.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(job.pid, signal.SIGKILL)
        shutil.rmtree(shm, ignore_errors=True)
