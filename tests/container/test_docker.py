"""A docker container checkpointed to a store and restored as a new container in another
dockerd ("VM"), with real dockerd, containerd, runc and CRIU (issue 29): the output continues
byte-identically and the writable layer comes along; a missing bind mount on the restoring
host is refused, one line, before anything is created; park in memory and unpark; a
leave-running checkpoint keeps the container running; an exit checkpoint whose upload fails
brings the container back in place. Through the agent and the controller (the scenario of
``spotguard demo --container --runtime docker``): a rebalance's leave-running checkpoint
(restored in place: the agent follows the new init process), a notice's exit checkpoint, the
relaunch on VM 2 whose agent restores the container from its assignment."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from docker_helpers import IMAGE, DockerVm

from sgtest import line_count, sg_env, wait_lines
from spotguard.container import ContainerImage
from spotguard.container.demo import Stage, run_container_demo
from spotguard.container.docker import Docker
from spotguard.image import ImageReader, ImageSettings

#: 15 s of work: the reference's park, unpark and leave-running come first, and on a loaded
#: host they took longer than the 6 s 120 lines gave (the job had ended: 'nothing to checkpoint')
LINES = 300
#: the job: a mark in its writable layer, then one line per step into its bind-mounted output
JOB = (
    f"echo layer >/tmp/mark; exec >>/data/out; i=0; while [ $i -lt {LINES} ]; do echo $i; "
    "i=$((i+1)); sleep 0.05; done"
)
EXPECTED = "".join(f"{i}\n" for i in range(LINES))


def _sg(vm: DockerVm, *args: str) -> subprocess.CompletedProcess[str]:
    """``spotguard COMMAND --json ARGS`` against the VM (:func:`sgtest.sg_env`)."""
    out = sg_env(args[0], "--json", *args[1:], env=vm.cli_env(), timeout=180)
    assert "Traceback" not in out.stderr, out.stderr
    return out


def _ok(vm: DockerVm, *args: str) -> dict[str, object]:
    out = _sg(vm, *args)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _refused(vm: DockerVm, *args: str) -> str:
    out = _sg(vm, *args)
    assert out.returncode != 0, out.stdout
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("spotguard:")]
    assert len(lines) == 1, out.stderr
    return lines[0]


def _status(vm: DockerVm, name: str) -> str:
    out = vm.cmd("inspect", "--format", "{{.State.Status}}", name, check=False)
    return out.strip() or "gone"


def _pid(vm: DockerVm, name: str) -> str:
    return vm.cmd("inspect", "--format", "{{.State.Pid}}", name).strip()


def _leftovers(tmp: Path) -> list[str]:
    """The copies of restored checkpoints docker's containerd left in its temp dir."""
    return sorted(p.name for p in tmp.glob("ctrd-checkpoint*"))


async def _record(url: str) -> ContainerImage:
    async with ImageReader(url, settings=ImageSettings()) as r:
        return ContainerImage.from_meta(r.manifest.meta, url)


def test_docker_container_checkpointed_removed_and_restored_in_another_dockerd(
    docker_vms: tuple[DockerVm, DockerVm],
) -> None:
    vm1, vm2 = docker_vms
    ref_dir, job_dir = vm1.base.parent / "ref", vm1.base.parent / "job"
    for name, d in (("ref", ref_dir), ("ctr", job_dir)):
        d.mkdir()
        started = _ok(
            vm1, "run", "--container", f"docker:{name}", "-v", f"{d}:/data",
            "--", IMAGE, "/bin/sh", "-c", JOB,
        )  # fmt: skip
        assert started["job"] == f"docker:{name}"
    wait_lines(job_dir / "out", 8)
    # the reference parks in memory (docker pause) and comes back: a pause, no gap
    assert _ok(vm1, "park", "docker:ref", "--to", "memory")["place"] == "memory"
    assert _status(vm1, "ref") == "paused"
    assert _ok(vm1, "unpark", "docker:ref")["place"] == "memory"
    assert _status(vm1, "ref") == "running"
    store = f"file://{vm1.base.parent / 'store'}"
    # leave-running: the reference is dumped, its layer taken, and restored in place; the
    # first `docker start --checkpoint` meets containerd still holding the checkpoint's
    # content ("already exists", seen on a loaded host) and is tried again
    once = vm1.base / "busy-once"
    busy = vm1.base / "docker-busy-once"
    busy.write_text(
        f'#!/bin/sh\ncase "$*" in *"start --checkpoint"*) if [ ! -e {once} ]; then '
        f"touch {once}; echo 'Error response from daemon: failed to upload checkpoint to "
        "containerd: commit failed: content sha256:0: already exists' >&2; exit 1; fi;; esac\n"
        f'exec {vm1.docker.binary} "$@"\n'
    )
    busy.chmod(0o755)
    out = sg_env(
        "checkpoint", "--json", "docker:ref", "--to", store, "--leave-running",
        env={**vm1.cli_env(), "SPOTGUARD_CONTAINER_DOCKER": str(busy)}, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lr = json.loads(out.stdout.strip().splitlines()[-1])
    assert lr["mode"] == "resume" and _status(vm1, "ref") == "running", lr
    assert once.exists() and "restore in place waits for containerd" in out.stderr
    # a store that takes the image's marker but no chunk: the exit checkpoint fails after
    # CRIU ended the container, which is restored in place from its checkpoint
    bad = vm1.base.parent / "bad-store"
    (bad / "docker-ctr").mkdir(parents=True)
    (bad / "docker-ctr" / "chunks").write_text("not a directory")
    pid = _pid(vm1, "ctr")
    said = _refused(vm1, "checkpoint", "docker:ctr", "--to", f"file://{bad}")
    assert "docker-ctr/chunks/" in said, said  # the upload failed, after the dump
    assert _status(vm1, "ctr") == "running" and _pid(vm1, "ctr") != pid  # restored
    wait_lines(job_dir / "out", line_count(job_dir / "out") + 3)  # it counts on, in place
    ck = _ok(vm1, "checkpoint", "docker:ctr", "--to", store)
    assert ck["mode"] == "exit" and ck["job"] == "docker-ctr", ck
    at_checkpoint = (job_dir / "out").read_text()
    assert 8 <= at_checkpoint.count("\n") < LINES
    assert _status(vm1, "ctr") == "gone"  # exit mode: removed once the image is durable
    time.sleep(0.3)
    assert (job_dir / "out").read_text() == at_checkpoint

    url = f"{store}/docker-ctr/images/latest"
    record = asyncio.run(_record(url))
    assert (record.runtime, record.config.name, record.config.image) == ("docker", "ctr", IMAGE)
    assert record.config.image_id.startswith("sha256:") and record.config.network_mode == "none"
    assert [(m.type, m.source, m.destination) for m in record.config.mounts] == [
        ("bind", str(job_dir), "/data")
    ]

    # VM 2 lacks the image, then the bind mount: refused by name, nothing created
    saved = subprocess.run(vm2.docker.argv("save", IMAGE), capture_output=True, check=True).stdout
    vm2.cmd("rmi", IMAGE)
    said = _refused(vm2, "restore", url)
    assert f"image {IMAGE} ({record.config.image_id[:19]}) is not on this host" in said, said
    vm2.cmd("load", "--quiet", stdin=saved)
    os.rename(job_dir, job_dir.with_name("elsewhere"))
    said = _refused(vm2, "restore", url)
    assert f"bind mount {job_dir} (at /data in docker:ctr) does not exist" in said, said
    assert vm2.cmd("ps", "-aq").split() == []  # nothing created
    os.rename(job_dir.with_name("elsewhere"), job_dir)

    # VM 2's restorer is killed (SIGKILL) the moment docker has started the container from
    # its checkpoint, before it records the outcome; run again, it takes over the container
    # its journal names by ID: one container, restored once, the counter not rerun — and
    # removes the copy of the checkpoint docker's containerd unpacked for the killed one
    theirs = vm2.runtime_dir / "ctrd-checkpoint0000"  # another restore's: never touched
    theirs.mkdir()
    (theirs / "inventory.img").write_bytes(b"\x00" * 86)
    killer = vm2.base / "docker-then-die"
    killer.write_text(
        f'#!/bin/sh\ncase "$*" in *"start --checkpoint"*) {vm2.docker.binary} "$@"; '
        f'kill -9 $PPID;; *) exec {vm2.docker.binary} "$@";; esac\n'
    )
    killer.chmod(0o755)
    died = subprocess.run(
        ["spotguard", "restore", "--json", url],
        env={**vm2.cli_env(), "SPOTGUARD_CONTAINER_DOCKER": str(killer)},
        capture_output=True, timeout=180, check=False,
    )  # fmt: skip
    assert died.returncode == -9, died.stderr[-2000:]
    assert _status(vm2, "ctr") == "running"
    mark = vm2.cmd("exec", "ctr", "/bin/sh", "-c", "read x </tmp/mark; echo $x")
    assert mark == "layer\n"  # the writable layer came along
    first = vm2.cmd("ps", "-aq", "--no-trunc").split()
    back = _ok(vm2, "restore", url)
    assert back["container"] == "docker:ctr" and [back["id"]] == first, (back, first)
    checkpoints = vm2.base / "data" / "containers" / first[0] / "checkpoints"
    assert not any(checkpoints.iterdir())  # CRIU's images copied in for the start: gone
    assert _leftovers(vm2.runtime_dir) == [theirs.name], "containerd's copy of the job stays"
    wait_lines(job_dir / "out", LINES)
    wait_lines(ref_dir / "out", LINES)
    time.sleep(0.3)
    assert (ref_dir / "out").read_text() == EXPECTED
    assert (job_dir / "out").read_text() == EXPECTED


async def _status_of(stage: Stage) -> dict[str, Any]:
    token = (stage.state_dir / "agent" / "api.token").read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    async with stage.http.get(f"{stage.api}/status", headers=headers) as r:
        [job] = (await r.json())["jobs"]
        out: dict[str, Any] = job
        return out


async def _rebalanced_on_vm1(stage: Stage) -> None:
    mine = await _status_of(stage)
    assert (mine["job"], mine["container"], mine["state"]) == (
        "docker-counter", "docker:counter", "protecting"
    )  # fmt: skip
    pid = mine["pid"]
    stage.sim1.state.send("aws", "rebalance")  # leave-running: restored in place, a new pid
    loop = asyncio.get_running_loop()
    end = loop.time() + 60
    while mine["checkpoints"] < 1 or mine["state"] != "protecting":
        assert loop.time() < end and mine["state"] != "finished", mine
        await asyncio.sleep(0.1)
        mine = await _status_of(stage)
    assert mine["last_image"]["mode"] == "resume" and mine["pid"] != pid, mine
    n = line_count(stage.data / "out")
    await asyncio.sleep(1.2)  # longer than the agent's liveness look (1 s)
    mine = await _status_of(stage)
    assert mine["state"] == "protecting" and line_count(stage.data / "out") > n, mine


async def _relaunched_on_vm2(stage: Stage) -> None:
    assert isinstance(stage.vm1, Docker) and isinstance(stage.vm2, Docker)
    assert await stage.vm1.inspect("counter") is None  # exit mode: gone from VM 1
    back = await stage.vm2.inspect("counter")
    assert back is not None and back["State"]["Status"] == "running", back
    assert [m["Source"] for m in back["Mounts"]] == [str(stage.data)]
    # VM 2's dockerd (spotguard's own: docker_vm) and its containerd keep no copy of it
    host = Path(stage.vm2.host.removeprefix("unix://"))
    assert _leftovers(host.parent / "tmp") == []


async def test_the_agent_guards_a_docker_container_and_the_controller_relaunches_it(
    docker_installed: Path, criu_bin: str, tmp_path: Path
) -> None:
    docker = Docker(
        binary=str(docker_installed / "bin" / "docker"), host="unix:///nonexistent.sock",
        runc="/opt/spotguard/containerd/bin/runc", criu=criu_bin, timeout=120,
    )  # fmt: skip
    result = await run_container_demo(
        docker, ImageSettings.model_validate({}), tmp_path, lambda _: None,
        protected=_rebalanced_on_vm1, relaunched=_relaunched_on_vm2,
    )  # fmt: skip
    assert result.ok, result
    assert result.history == [
        "protected", "interrupting", "protected",  # the rebalance: resumed
        "interrupting", "checkpointed", "launching", "restoring", "protected", "finished",
    ]  # fmt: skip
