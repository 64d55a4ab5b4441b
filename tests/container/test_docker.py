"""A docker container checkpointed to a store and restored as a new container in another
dockerd ("VM"), with real dockerd, containerd, runc and CRIU (issue 29): the output continues
byte-identically and the writable layer comes along; a missing bind mount on the restoring
host is refused, one line, before anything is created; park in memory and unpark; a
leave-running checkpoint keeps the container running; an exit checkpoint whose upload fails
brings the container back in place."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time

from docker_helpers import IMAGE, DockerVm

from sgtest import line_count, wait_lines
from spotguard.container import ContainerImage
from spotguard.image import ImageReader, ImageSettings

LINES = 120
#: the job: a mark in its writable layer, then one line per step into its bind-mounted output
JOB = (
    f"echo layer >/tmp/mark; exec >>/data/out; i=0; while [ $i -lt {LINES} ]; do echo $i; "
    "i=$((i+1)); sleep 0.05; done"
)
EXPECTED = "".join(f"{i}\n" for i in range(LINES))


def _sg(vm: DockerVm, *args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        ["spotguard", args[0], "--json", *args[1:]],
        env=vm.cli_env(), capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
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
    # leave-running: the reference is dumped, its layer taken, and restored in place
    lr = _ok(vm1, "checkpoint", "docker:ref", "--to", store, "--leave-running")
    assert lr["mode"] == "resume" and _status(vm1, "ref") == "running", lr
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

    os.rename(job_dir, job_dir.with_name("elsewhere"))
    said = _refused(vm2, "restore", url)
    assert f"bind mount {job_dir} (at /data in docker:ctr) does not exist" in said, said
    assert vm2.cmd("ps", "-aq").split() == []  # nothing created
    os.rename(job_dir.with_name("elsewhere"), job_dir)

    back = _ok(vm2, "restore", url)
    assert back["container"] == "docker:ctr", back
    mark = vm2.cmd("exec", "ctr", "/bin/sh", "-c", "read x </tmp/mark; echo $x")
    assert mark == "layer\n"  # the writable layer came along
    wait_lines(job_dir / "out", LINES)
    wait_lines(ref_dir / "out", LINES)
    time.sleep(0.3)
    assert (ref_dir / "out").read_text() == EXPECTED
    assert (job_dir / "out").read_text() == EXPECTED
