"""A containerd container checkpointed to a store and restored as a new container in another
containerd ("VM"), with real containerd, runc and CRIU (issue 29): the output continues
byte-identically and the writable layer comes along; a missing image or bind mount on the
restoring host is refused, one line, before anything is created. Through the agent and the
controller (the scenario of ``spotguard demo --container --runtime containerd``): a
rebalance's leave-running checkpoint, a notice's exit checkpoint, the relaunch on VM 2 whose
agent restores the container from its assignment; the counter goes on without a gap."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from containerd_helpers import IMAGE, NS, CtrVm

from sgtest import line_count, sg_env, wait_lines
from spotguard.container import Containerd, ContainerImage, ContainerRef
from spotguard.container.demo import Stage, run_container_demo
from spotguard.image import ImageReader, ImageSettings

#: 15 s: the job must outlive a park, a failed checkpoint and its in-place restore on a
#: loaded host (at 6 s a clean-clone CI run found it ended before the last checkpoint)
LINES = 300
#: the job: a mark in its writable layer, then one line per step into its bind-mounted output
JOB = (
    f"echo layer >/tmp/mark; exec >>/data/out; i=0; while [ $i -lt {LINES} ]; do echo $i; "
    "i=$((i+1)); sleep 0.05; done"
)
EXPECTED = "".join(f"{i}\n" for i in range(LINES))


def _sg(vm: CtrVm, *args: str) -> subprocess.CompletedProcess[str]:
    """``spotguard COMMAND --json ARGS`` against the VM (:func:`sgtest.sg_env`)."""
    out = sg_env(args[0], "--json", *args[1:], env=vm.cli_env(), timeout=180)
    assert "Traceback" not in out.stderr, out.stderr
    return out


def _ok(vm: CtrVm, *args: str) -> dict[str, object]:
    out = _sg(vm, *args)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _refused(vm: CtrVm, *args: str) -> str:
    out = _sg(vm, *args)
    assert out.returncode != 0, out.stdout
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("spotguard:")]
    assert len(lines) == 1, out.stderr
    return lines[0]


def _task(vm: CtrVm, cid: str) -> tuple[str, str]:
    """(pid, status) of the container's task."""
    for line in vm.ctr("tasks", "ls").splitlines()[1:]:
        name, pid, status = line.split()[:3]
        if name == cid:
            return pid, status
    return "", ""


def _leftovers(runtime_dir: Path) -> list[str]:
    """The copies of restored checkpoints containerd left in its runtime directory."""
    return sorted(p.name for p in runtime_dir.glob("ctrd-checkpoint*"))


async def _record(url: str) -> ContainerImage:
    async with ImageReader(url, settings=ImageSettings()) as r:
        return ContainerImage.from_meta(r.manifest.meta, url)


def test_containerd_container_checkpointed_removed_and_restored_in_another_containerd(
    ctr_vms: tuple[CtrVm, CtrVm],
) -> None:
    vm1, vm2 = ctr_vms
    ref_dir, job_dir = vm1.base.parent / "ref", vm1.base.parent / "job"
    for name, d in (("ref", ref_dir), ("ctr", job_dir)):
        d.mkdir()
        started = _ok(
            vm1, "run", "--container", f"containerd:{NS}/{name}", "-v", f"{d}:/data",
            "--", IMAGE, "/bin/sh", "-c", JOB,
        )  # fmt: skip
        assert started["job"] == f"containerd:{NS}/{name}"
    wait_lines(job_dir / "out", 8)
    # the reference parks in memory (the cgroup freezer) and comes back: a pause, no gap
    parked = _ok(vm1, "park", f"containerd:{NS}/ref", "--to", "memory")
    assert parked["place"] == "memory" and "PAUSED" in vm1.ctr("tasks", "ls")
    assert _ok(vm1, "unpark", f"containerd:{NS}/ref")["place"] == "memory"
    assert "PAUSED" not in vm1.ctr("tasks", "ls")
    said = _refused(vm1, "park", f"containerd:{NS}/ref", "--to", "disk")
    assert "a containerd container parks to memory or a store URL" in said, said
    # a store that takes the image's marker but no chunk: the exit checkpoint fails after
    # CRIU ended the task, and the container is restored in place from its checkpoint
    bad = vm1.base.parent / "bad-store"
    (bad / f"containerd-{NS}-ctr").mkdir(parents=True)
    (bad / f"containerd-{NS}-ctr" / "chunks").write_text("not a directory")
    before = _task(vm1, "ctr")
    said = _refused(vm1, "checkpoint", f"containerd:{NS}/ctr", "--to", f"file://{bad}")
    assert f"containerd-{NS}-ctr/chunks/" in said, said  # the upload failed, after the dump
    after = _task(vm1, "ctr")
    assert after[1] == "RUNNING" and after[0] != before[0], (before, after)  # restored
    wait_lines(job_dir / "out", line_count(job_dir / "out") + 3)  # it counts on, in place
    store = f"file://{vm1.base.parent / 'store'}"
    ck = _ok(vm1, "checkpoint", f"containerd:{NS}/ctr", "--to", store)
    assert ck["mode"] == "exit" and ck["job"] == f"containerd-{NS}-ctr", ck
    at_checkpoint = (job_dir / "out").read_text()
    assert 8 <= at_checkpoint.count("\n") < LINES
    # exit mode: the container is gone from VM 1 once its image is durable, and stopped
    assert "ctr" not in vm1.ctr("containers", "ls", "-q").split()
    time.sleep(0.3)
    assert (job_dir / "out").read_text() == at_checkpoint

    url = f"{store}/containerd-{NS}-ctr/images/latest"
    record = asyncio.run(_record(url))
    assert (record.runtime, record.namespace, record.config.name) == ("containerd", NS, "ctr")
    assert record.config.image == IMAGE and record.config.image_id.startswith("sha256:")
    assert [(m.type, m.source, m.destination) for m in record.config.mounts] == [
        ("bind", str(job_dir), "/data")
    ]
    assert record.config.network_mode == "none" and record.criu_version.startswith("4.")

    # VM 2 lacks the image, then the bind mount: refused by name, nothing created
    said = _refused(vm2, "restore", url)
    assert f"image {IMAGE}" in said and "not in containerd namespace sg" in said, said
    assert "cannot be pulled" in said, said  # a localhost/ image: no registry to pull from
    vm2.ctr("images", "import", str(vm1.base.parent / "image.tar"))
    os.rename(job_dir, job_dir.with_name("elsewhere"))
    said = _refused(vm2, "restore", url)
    assert f"bind mount {job_dir} (at /data in containerd:{NS}/ctr) does not exist" in said, said
    assert vm2.ctr("containers", "ls", "-q").split() == []
    os.rename(job_dir.with_name("elsewhere"), job_dir)

    # VM 2's restorer is killed (SIGKILL) the moment ctr has restored the container, before
    # it records the outcome; run again, it takes over the container its journal names
    # (made after the intent): one container, restored once, the counter not rerun — and
    # removes the copy of the checkpoint containerd unpacked for the killed one's restore
    theirs = vm2.runtime_dir / "ctrd-checkpoint0000"  # another restore's: never touched
    theirs.mkdir()
    (theirs / "inventory.img").write_bytes(b"\x00" * 86)
    killer = vm2.base / "ctr-then-die"
    killer.write_text(
        f'#!/bin/sh\ncase "$*" in *"containers restore"*) {vm2.ctrd.ctr} "$@"; kill -9 $PPID;; '
        f'*) exec {vm2.ctrd.ctr} "$@";; esac\n'
    )
    killer.chmod(0o755)
    died = subprocess.run(
        ["spotguard", "restore", "--json", url],
        env={**vm2.cli_env(), "SPOTGUARD_CONTAINER_CTR": str(killer)},
        capture_output=True, timeout=180, check=False,
    )  # fmt: skip
    assert died.returncode == -9, died.stderr[-2000:]
    first = _task(vm2, "ctr")
    assert first[1] == "RUNNING", first
    mark = vm2.ctr(
        "tasks", "exec", "--exec-id", "m", "ctr", "/bin/sh", "-c", "read x </tmp/mark; echo $x"
    )
    assert mark == "layer\n"  # the writable layer came along
    back = _ok(vm2, "restore", url)
    assert back["container"] == f"containerd:{NS}/ctr", back
    assert _task(vm2, "ctr") == first  # taken over, not restored again
    assert _leftovers(vm2.runtime_dir) == [theirs.name], "containerd's copy of the job stays"
    wait_lines(job_dir / "out", LINES)
    wait_lines(ref_dir / "out", LINES)
    time.sleep(0.3)
    assert (ref_dir / "out").read_text() == EXPECTED
    assert (job_dir / "out").read_text() == EXPECTED
    assert vm2.ctr("images", "ls", "-q").split() == [IMAGE]  # the checkpoint image is gone


async def _status(stage: Stage) -> dict[str, Any]:
    token = (stage.state_dir / "agent" / "api.token").read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    async with stage.http.get(f"{stage.api}/status", headers=headers) as r:
        [job] = (await r.json())["jobs"]
        out: dict[str, Any] = job
        return out


async def _rebalanced_on_vm1(stage: Stage) -> None:
    mine = await _status(stage)
    assert (mine["job"], mine["container"], mine["state"]) == (
        "containerd-demo-counter", "containerd:demo/counter", "protecting"
    )  # fmt: skip
    pid = mine["pid"]
    stage.sim1.state.send("aws", "rebalance")  # leave-running: containerd resumes the task
    loop = asyncio.get_running_loop()
    end = loop.time() + 60
    while mine["checkpoints"] < 1 or mine["state"] != "protecting":
        assert loop.time() < end and mine["state"] != "finished", mine
        await asyncio.sleep(0.1)
        mine = await _status(stage)
    assert mine["last_image"]["mode"] == "resume" and mine["pid"] == pid, mine
    n = line_count(stage.data / "out")
    await asyncio.sleep(1.2)  # longer than the agent's liveness look (1 s)
    mine = await _status(stage)
    assert mine["state"] == "protecting" and line_count(stage.data / "out") > n, mine


async def _relaunched_on_vm2(stage: Stage) -> None:
    ref = ContainerRef.parse("containerd:demo/counter")
    assert isinstance(stage.vm1, Containerd) and isinstance(stage.vm2, Containerd)
    assert await stage.vm1.inspect(ref) is None  # exit mode: gone from VM 1
    back = await stage.vm2.inspect(ref)
    assert back is not None and back["State"]["Status"] == "running", back
    v = await stage.job()
    assert v["instance"]["instance_id"] == "i-0demovm2demovm2", v
    # VM 2's daemon (spotguard's own: containerd_vm) keeps no copy of the restored checkpoint
    assert _leftovers(stage.vm2.address.parent / "xdg") == []


async def test_the_agent_guards_a_containerd_container_and_the_controller_relaunches_it(
    containerd_installed: Path, criu_bin: str, tmp_path: Path
) -> None:
    bindir = containerd_installed / "bin"
    ctrd = Containerd(
        ctr=str(bindir / "ctr"), address=tmp_path / "unused.sock", runc=str(bindir / "runc"),
        criu=criu_bin, timeout=120,
    )  # fmt: skip
    result = await run_container_demo(
        ctrd, ImageSettings.model_validate({}), tmp_path, lambda _: None,
        protected=_rebalanced_on_vm1, relaunched=_relaunched_on_vm2,
    )  # fmt: skip
    assert result.ok, result
    assert result.history == [
        "protected", "interrupting", "protected",  # the rebalance: resumed
        "interrupting", "checkpointed", "launching", "restoring", "protected", "finished",
    ]  # fmt: skip
