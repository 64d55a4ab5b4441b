"""Issue 28.5: a relaunched agent that refused to start is recorded with its real reason.

The controller relaunches a job onto a local "VM" whose command is the real ``spotguard agent``,
given a setting it refuses (``SPOTGUARD_PERIODIC_INTERVAL=inf``: exit 2 with one line). The
job's history must say that the agent exited with status 2 and quote its error line, not only
"terminated before the job was restored"."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import aiohttp
import pytest
from controller_helpers import VM1, Api, settings

from spotguard.contracts import Assignment, EventKind
from spotguard.controller.server import ControllerServer
from spotguard.errors import ProviderError
from spotguard.image.settings import ImageSettings
from spotguard.providers.base import InstanceState, LaunchSpec
from spotguard.providers.local import LocalProvider, LocalSettings

REFUSAL = "periodic_interval: Input should be a finite number"


def _refusing(tmp_path: Path) -> LocalProvider:
    """Local VMs running the real ``spotguard agent`` with a setting it refuses at start."""
    exe = Path(sys.executable).with_name("spotguard")
    command = [str(exe) if exe.exists() else (shutil.which("spotguard") or "spotguard"), "agent"]
    return LocalProvider(
        LocalSettings(
            local_root=tmp_path / "local",
            local_agent_command=command,
            local_env={"SPOTGUARD_PERIODIC_INTERVAL": "inf", "SPOTGUARD_CLOUD": "none"},
            local_gpus=False,
        )
    )


async def test_a_relaunched_agent_that_refused_to_start_is_recorded_with_its_error(
    tmp_path: Path,
) -> None:
    prov = _refusing(tmp_path)
    srv = ControllerServer(
        settings(tmp_path, max_restarts=1, liveness_s=0.1),
        provider=prov,
        image=ImageSettings.model_validate({}),
    )
    async with srv, aiohttp.ClientSession() as session:
        api = Api(srv.url, session)
        await api.event("refused", EventKind.STARTED, instance=VM1)
        image = f"file://{tmp_path}/store/refused/images/20261122T000000000000Z-abc123"
        await api.event("refused", EventKind.EXITED, instance=VM1, image_url=image)
        view = await api.wait_state("refused", "failed", within=60)
    lost = [
        h["reason"] for h in view["history"] if (h["from"], h["to"]) == ("restoring", "launching")
    ]
    assert lost, view["history"]
    assert "exited with status 2" in lost[0], lost[0]
    assert REFUSAL in lost[0], lost[0]
    assert "\n" not in lost[0]  # one line, like every reason


async def test_the_local_provider_describes_why_a_vm_ended(tmp_path: Path) -> None:
    """describe() of a local VM whose agent exited names its exit status and its error line,
    also from a provider opened afresh (a restarted controller: the log only); wait_ready()
    says the same."""
    prov = _refusing(tmp_path)
    offer = (await prov.offers(LaunchSpec()))[0]
    assignment = Assignment(job="why", image_url="", store=f"file://{tmp_path}/store")
    ref = await prov.launch(offer, assignment, client_token="why-1")
    for _ in range(300):
        cur = await prov.describe(ref)
        if cur.state is InstanceState.TERMINATED:
            break
        await asyncio.sleep(0.1)
    assert cur.state is InstanceState.TERMINATED
    assert cur.state_reason is not None
    assert cur.state_reason.startswith("the agent exited with status 2: spotguard: error: ")
    assert REFUSAL in cur.state_reason
    with pytest.raises(ProviderError, match=REFUSAL):
        await prov.wait_ready(ref, 1.0)
    later = await LocalProvider(prov.settings).describe(ref)
    assert later.state is InstanceState.TERMINATED
    assert later.state_reason is not None
    assert later.state_reason.startswith("the agent exited: spotguard: error: ")
    assert REFUSAL in later.state_reason
