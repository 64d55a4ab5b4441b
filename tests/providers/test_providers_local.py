"""The local provider's VM records: what the controller (and anything else reading
``vm.json``) sees while a VM is launched and terminated."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from spotguard.contracts import Assignment
from spotguard.providers.base import InstanceState, LaunchSpec
from spotguard.providers.local import LocalProvider, LocalSettings

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


async def test_a_reader_of_vm_json_never_sees_a_torn_record_while_the_vm_is_terminated(
    tmp_path: Path,
) -> None:
    """Terminating rewrote ``vm.json`` in place (truncate, then write): a reader in between
    — the controller's describe, a test's or the demo's clean-up — read an empty file, and
    describe took the VM for gone. The record is replaced whole: a reader that opened it
    before the terminate still reads the full old record, and the new one says terminated."""
    prov = LocalProvider(
        LocalSettings(local_root=tmp_path / "local", local_agent_command=SLEEPER, local_gpus=False)
    )
    offer = (await prov.offers(LaunchSpec()))[0]
    a = Assignment(
        job="j", image_url=f"file://{tmp_path}/s/j/images/x", store=f"file://{tmp_path}/s"
    )
    ref = await prov.launch(offer, a, client_token="r1-0")
    assert ref.state is InstanceState.RUNNING
    path = tmp_path / "local" / "vms" / ref.instance_id / "vm.json"
    before = json.loads(path.read_text())
    with path.open() as held:  # a reader that opened the record just before the terminate
        await prov.terminate(ref)
        seen = held.read()
    assert seen, "a reader saw the VM record emptied while it was rewritten"
    assert json.loads(seen) == before
    after = json.loads(path.read_text())
    assert after["terminated"] is True
    assert after["pid"] == before["pid"]
    assert (await prov.describe(ref)).state is InstanceState.TERMINATED
