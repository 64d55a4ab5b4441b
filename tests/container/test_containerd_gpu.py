"""A GPU containerd container (issue 29) with real containerd, runc and CRIU and the driver
double (``RecordingGpu``, tests/container/gpu_helpers.py) standing in for the driver: the
task's GPU processes are locked and checkpointed before ``ctr tasks checkpoint`` and restored
and unlocked after it (leave-running: the task goes on, same processes), after the in-place
restore of a failed exit checkpoint, and after ``ctr containers restore`` of the new container
in another containerd ("VM") with the image's GPUs mapped onto that host's; a failed lock
leaves the task running and nothing locked; the image's record carries the GPUs; a host whose
GPUs cannot take them is refused in one line before containerd creates anything; park in
memory frees the GPU before ``ctr tasks pause`` and unpark restores it after ``resume``."""

from __future__ import annotations

import pytest
from containerd_helpers import IMAGE, NS, CtrVm
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
from spotguard.container import Containerd, ContainerRef, dispatch
from spotguard.container.containerd_ops import spec_of
from spotguard.errors import GpuError, MismatchError, SpotguardError

#: the job: one line per step into its bind-mounted output
JOB = "exec >>/data/out; i=0; while :; do echo $i; i=$((i+1)); sleep 0.05; done"
REF = ContainerRef.parse(f"containerd:{NS}/gpu")
#: the ctr commands the order is checked against
SEEN = (
    "ctr tasks checkpoint", "ctr containers restore", "ctr tasks pause", "ctr tasks resume",
)  # fmt: skip


async def _pid(ctrd: Containerd) -> int:
    status, pid = await ctrd.task(REF)
    assert status == "RUNNING", status
    return pid


async def test_a_containerd_gpu_container_is_locked_around_ctr_and_restored_onto_mapped_gpus(
    ctr_vms: tuple[CtrVm, CtrVm], monkeypatch: pytest.MonkeyPatch
) -> None:
    vm1, vm2 = ctr_vms
    log: Log = []
    log_commands(monkeypatch, Containerd, "ctr", log)
    data = vm1.base.parent / "data"
    data.mkdir()
    store = f"file://{vm1.base.parent / 'store'}"
    on1 = On(vm1.ctrd, vm1.state_dir)
    # `,bind`: this mount only, not its submounts (as podman's; the GPU test binds the host's
    # /usr and each mount under it one by one)
    await dispatch.start(
        REF, IMAGE, ["/bin/sh", "-c", JOB], backend=vm1.ctrd, volumes=[f"{data}:/data:rw,bind"]
    )
    info = await vm1.ctrd.info(REF)
    assert info is not None
    [bind] = [m for m in spec_of(info)["mounts"] if m["destination"] == "/data"]
    assert bind["options"] == ["bind", "rw"], bind
    wait_lines(data / "out", 3)
    here = use(monkeypatch, CriuGpu(host("GPU-a0", "GPU-a1"), log=log))

    # the driver fails to checkpoint: unlocked again, ctr never asked, the task runs on
    here.fail_on = "checkpoint"
    p1 = await _pid(vm1.ctrd)
    with pytest.raises(GpuError, match="injected failure in GPU checkpoint"):
        await on1.checkpoint(REF, store, leave_running=True)
    assert steps(log, *SEEN) == [f"lock {p1}", f"checkpoint {p1}", f"unlock {p1}"]
    assert here.stuck() == {} and await _pid(vm1.ctrd) == p1

    # leave-running: lock + checkpoint before ctr's dump; the task goes on (the same
    # processes), then the driver restores and unlocks them
    ck = await on1.checkpoint(REF, store, leave_running=True)
    assert await _pid(vm1.ctrd) == p1
    assert steps(log, *SEEN) == [
        f"lock {p1}", f"checkpoint {p1}", "ctr tasks checkpoint", f"restore {p1}", f"unlock {p1}"
    ]  # fmt: skip
    assert here.stuck() == {}
    gpus = (await record_of(ck.image_url)).gpu
    assert gpus is not None and [d.uuid for d in gpus.devices] == ["GPU-a0", "GPU-a1"]

    # an exit checkpoint whose upload fails after the dump: the container is restored in
    # place from its checkpoint and the driver restores and unlocks it — nothing left locked
    job = f"containerd-{NS}-gpu"
    bad = vm1.base.parent / "bad-store"
    (bad / job).mkdir(parents=True)
    (bad / job / "chunks").write_text("not a directory")
    with pytest.raises(SpotguardError, match=f"{job}/chunks/"):
        await on1.checkpoint(REF, f"file://{bad}")
    p2 = await _pid(vm1.ctrd)
    wait_lines(data / "out", line_count(data / "out") + 3)  # it counts on, in place
    assert p2 != p1
    assert steps(log, *SEEN) == [
        f"lock {p1}", f"checkpoint {p1}", "ctr tasks checkpoint", "ctr containers restore",
        f"restore {p2}", f"unlock {p2}",
    ]  # fmt: skip
    assert here.stuck() == {}

    # exit mode: the GPU state goes into the image with the process, the record names the GPUs
    ck = await on1.checkpoint(REF, store)
    assert steps(log, *SEEN) == [f"lock {p2}", f"checkpoint {p2}", "ctr tasks checkpoint"]
    assert not await vm1.ctrd.exists(REF)
    assert (await record_of(ck.image_url)).gpu == gpus
    stopped = line_count(data / "out")

    # VM 2's GPUs are another model: refused in one line before containerd creates anything
    vm2.ctr("images", "import", str(vm1.base.parent / "image.tar"))
    on2 = On(vm2.ctrd, vm2.state_dir)
    use(monkeypatch, CriuGpu(host("GPU-b0", "GPU-b1", model="NVIDIA A10G"), log=log, dumped=1))
    with pytest.raises(MismatchError, match="GPU model") as refused:
        await on2.restore(ck.image_url)
    assert "\n" not in str(refused.value)
    assert steps(log, *SEEN, "ctr images import") == []
    assert vm2.ctr("containers", "ls", "-q").split() == []

    # the driver's restore fails after containerd restored the container: the container is
    # removed, never left running GPU-locked, and the image restores again afterwards
    broken = CriuGpu(host("GPU-b0", "GPU-b1"), log=log, dumped=1, fail_on="restore")
    use(monkeypatch, broken)
    with pytest.raises(GpuError, match="injected failure in GPU restore"):
        await on2.restore(ck.image_url)
    assert not await vm2.ctrd.exists(REF)
    log.clear()
    # this stand-in job counts on the CPU, so it wrote on until removed (a GPU job blocks at
    # its first CUDA call while locked): its file back to where the checkpoint stopped it
    kept = (data / "out").read_text().splitlines()[:stopped]
    (data / "out").write_text("".join(f"{x}\n" for x in kept))

    # VM 2 with three GPUs of the model: the image's two map onto its first two; containerd
    # restores the container, then the driver restores its process onto them and unlocks it
    there = use(monkeypatch, CriuGpu(host("GPU-b0", "GPU-b1", "GPU-b2"), log=log, dumped=1))
    await on2.restore(ck.image_url)
    p3 = await _pid(vm2.ctrd)
    assert steps(log, *SEEN) == ["ctr containers restore", f"restore {p3}", f"unlock {p3}"]
    assert there.remaps == [{"GPU-a0": "GPU-b0", "GPU-a1": "GPU-b1"}]
    assert there.stuck() == {}

    # parked in memory: the GPU freed before the pause; unpark puts it back after the resume
    await park_and_unpark(on2, REF, there, p3, log, SEEN, "ctr tasks pause", "ctr tasks resume")
    counted_on(data / "out", stopped)
