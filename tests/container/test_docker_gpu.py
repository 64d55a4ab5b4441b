"""A GPU docker container (issue 29) with real dockerd, containerd, runc and CRIU and the
driver double (``RecordingGpu``, tests/container/gpu_helpers.py) standing in for the driver:
the container's GPU processes are locked and checkpointed before ``docker checkpoint
create`` and restored and unlocked after the runtime's restore — in place after a
leave-running checkpoint or a failed exit checkpoint, as the new container on another dockerd
("VM") with the image's GPUs mapped onto that host's —; a failed lock leaves the container
running and nothing locked; the image's record carries the GPUs; a host whose GPUs cannot take
them is refused in one line before docker creates anything; park in memory frees the GPU
before ``docker pause`` and unpark restores it after ``docker unpause``."""

from __future__ import annotations

import pytest
from docker_helpers import IMAGE, DockerVm
from gpu_helpers import (
    CriuGpu,
    Log,
    On,
    counted_on,
    host,
    log_commands,
    park_and_unpark,
    record_of,
    steps,
    use,
)

from sgtest import line_count, wait_lines
from spotguard.container import ContainerRef, dispatch
from spotguard.container.docker import Docker
from spotguard.errors import GpuError, MismatchError, SpotguardError

#: the job: one line per step into its bind-mounted output
JOB = "exec >>/data/out; i=0; while :; do echo $i; i=$((i+1)); sleep 0.05; done"
REF = ContainerRef.parse("docker:gpu")
#: the docker commands the order is checked against
SEEN = (
    "docker checkpoint create", "docker start --checkpoint", "docker create", "docker pause",
    "docker unpause",
)  # fmt: skip


def _pid(vm: DockerVm) -> int:
    return int(vm.cmd("inspect", "--format", "{{.State.Pid}}", REF.name).strip() or 0)


async def test_a_docker_gpu_container_is_locked_around_docker_and_restored_onto_mapped_gpus(
    docker_vms: tuple[DockerVm, DockerVm], monkeypatch: pytest.MonkeyPatch
) -> None:
    vm1, vm2 = docker_vms
    log: Log = []
    log_commands(monkeypatch, Docker, "docker", log)
    data = vm1.base.parent / "data"
    data.mkdir()
    store = f"file://{vm1.base.parent / 'store'}"
    on1 = On(vm1.docker, vm1.state_dir)
    await dispatch.start(
        REF, IMAGE, ["/bin/sh", "-c", JOB], backend=vm1.docker, volumes=[f"{data}:/data"]
    )
    wait_lines(data / "out", 3)
    here = use(monkeypatch, CriuGpu(host("GPU-a0", "GPU-a1"), log=log))

    # the driver fails to checkpoint: unlocked again, docker never asked, the job runs on
    here.fail_on = "checkpoint"
    p1 = _pid(vm1)
    with pytest.raises(GpuError, match="injected failure in GPU checkpoint"):
        await on1.checkpoint(REF, store, leave_running=True)
    assert steps(log, *SEEN) == [f"lock {p1}", f"checkpoint {p1}", f"unlock {p1}"]
    assert here.stuck() == {} and _pid(vm1) == p1

    # leave-running: lock + checkpoint before docker's dump; docker restores the container in
    # place (a new init process), then the driver restores and unlocks it
    ck = await on1.checkpoint(REF, store, leave_running=True)
    p2 = _pid(vm1)
    assert p2 not in (0, p1)
    assert steps(log, *SEEN) == [
        f"lock {p1}", f"checkpoint {p1}", "docker checkpoint create",
        "docker start --checkpoint", f"restore {p2}", f"unlock {p2}",
    ]  # fmt: skip
    assert here.stuck() == {}
    gpus = (await record_of(ck.image_url)).gpu
    assert gpus is not None and [d.uuid for d in gpus.devices] == ["GPU-a0", "GPU-a1"]

    # an exit checkpoint whose upload fails after the dump: docker brings the container back
    # in place and the driver restores and unlocks it — nothing left locked or checkpointed
    bad = vm1.base.parent / "bad-store"
    (bad / "docker-gpu").mkdir(parents=True)
    (bad / "docker-gpu" / "chunks").write_text("not a directory")
    with pytest.raises(SpotguardError, match="docker-gpu/chunks/"):
        await on1.checkpoint(REF, f"file://{bad}")
    p3 = _pid(vm1)
    wait_lines(data / "out", line_count(data / "out") + 3)  # it counts on, in place
    assert p3 not in (0, p2)
    assert steps(log, *SEEN) == [
        f"lock {p2}", f"checkpoint {p2}", "docker checkpoint create",
        "docker start --checkpoint", f"restore {p3}", f"unlock {p3}",
    ]  # fmt: skip
    assert here.stuck() == {}

    # exit mode: the GPU state goes into the image with the process, the record names the GPUs
    ck = await on1.checkpoint(REF, store)
    assert steps(log, *SEEN) == [f"lock {p3}", f"checkpoint {p3}", "docker checkpoint create"]
    assert await vm1.docker.inspect(REF.name) is None
    record = await record_of(ck.image_url)
    assert record.gpu == gpus
    stopped = line_count(data / "out")

    # VM 2's GPUs are another model: refused in one line before docker creates anything
    on2 = On(vm2.docker, vm2.state_dir)
    use(monkeypatch, CriuGpu(host("GPU-b0", "GPU-b1", model="NVIDIA A10G"), log=log, dumped=1))
    with pytest.raises(MismatchError, match="GPU model") as refused:
        await on2.restore(ck.image_url)
    assert "\n" not in str(refused.value)
    assert steps(log, *SEEN) == [] and vm2.cmd("ps", "-aq").split() == []

    # VM 2 with three GPUs of the model: the image's two map onto its first two; docker
    # restores the container, then the driver restores its process onto them and unlocks it
    there = use(monkeypatch, CriuGpu(host("GPU-b0", "GPU-b1", "GPU-b2"), log=log, dumped=1))
    await on2.restore(ck.image_url)
    p4 = _pid(vm2)
    assert steps(log, *SEEN) == [
        "docker create", "docker start --checkpoint", f"restore {p4}", f"unlock {p4}"
    ]  # fmt: skip
    assert there.remaps == [{"GPU-a0": "GPU-b0", "GPU-a1": "GPU-b1"}]
    assert there.stuck() == {}

    # parked in memory: the GPU freed before docker pause; unpark puts it back after unpause
    await park_and_unpark(on2, REF, there, p4, log, SEEN, "docker pause", "docker unpause")
    counted_on(data / "out", stopped)
