"""``spotguard demo --container``: the demo's story with a real podman container, two podman
storages as two VMs, real agents, the controller and the local provider; it must prove the
counter went on without a gap or a repeat, and leave no container, agent or mount behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sgtest import without_spotguard_settings

SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))


def test_container_demo_relaunches_the_container_on_vm2_and_proves_it_counted_on(
    podman_bin: str, criu_bin: str, tmp_path: Path
) -> None:
    work = tmp_path / "demo"
    env = without_spotguard_settings(SPOTGUARD_CONTAINER_PODMAN=podman_bin, SPOTGUARD_CRIU=criu_bin)
    out = subprocess.run(
        [SPOTGUARD, "demo", "--container", "--json", "--workdir", str(work)],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    result = json.loads(out.stdout[out.stdout.index("{") :])
    assert result["ok"] is True and result["numbers"] > 10, result
    assert result["history"] == [
        "protected", "interrupting", "checkpointed", "launching", "restoring", "protected",
        "finished",
    ]  # fmt: skip
    assert result["image_url"].startswith(f"file://{work}/store/podman-counter/images/")
    assert "VM 2 restored it" in out.stderr
    mounts = Path("/proc/mounts").read_text()
    assert str(work) not in mounts, "a container's mount was left behind"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    assert str(work) not in ps.stdout, "a process of the demo was left running"
