"""A GPU container restored on another host: the checkpoint records the host's GPUs in the
image's container record, and the restore maps them onto the target's as a process job's
restore does (same model and driver major, at least as many GPUs, same UUIDs kept, others in
order), refusing a mismatch before podman runs, and hands the pairs to the driver's restore.
Without a GPU: the public driver double (``RecordingGpu``) and a real process standing for
the container's init (the runtime's answer, its pid, given by a stand-in). The driver's
restore onto other GPUs inside a container is for the GPU tests to show."""

from __future__ import annotations

import subprocess
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence

import pytest

from spotguard.checkpoint.cuda import GpuState
from spotguard.checkpoint.testing import RecordingGpu
from spotguard.container.gpu import ContainerGpu
from spotguard.container.spec import ContainerImage
from spotguard.errors import MismatchError
from spotguard.facts import GpuDevice, GpuInventory
from spotguard.timeline import Timeline

H100 = "NVIDIA H100 80GB HBM3"


def _host(*uuids: str, model: str = H100, driver: str = "580.159.04") -> GpuInventory:
    return GpuInventory(
        devices=tuple(GpuDevice(i, u, model, 80 << 30) for i, u in enumerate(uuids)),
        driver=driver,
    )


def _init(pid: int) -> Callable[[], Awaitable[int]]:
    """The runtime's answer for one running container whose init is ``pid``."""

    async def init_pid() -> int:
        return pid

    return init_pid


class _Driver(RecordingGpu):
    """The double, remembering the pairs each restore was given."""

    def __init__(self, inventory: GpuInventory) -> None:
        super().__init__(inventory=inventory)
        self.remaps: list[Mapping[str, str] | None] = []

    async def restore(self, pids: Sequence[int], remap: Mapping[str, str] | None = None) -> None:
        self.remaps.append(remap)
        await super().restore(pids, remap)


@pytest.fixture
def init() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


async def test_the_gpus_travel_in_the_record_and_are_mapped_onto_the_new_hosts(
    init: int,
) -> None:
    old = _host("GPU-a0", "GPU-a1")
    here = ContainerGpu(_init(init), "podman:train", _Driver(old))
    assert await here.freeze(Timeline()) == [init]
    record = here.record()
    assert record is not None and [d.uuid for d in record.devices] == ["GPU-a0", "GPU-a1"]
    config = {"id": "c" * 64, "name": "train", "image": "img", "image_id": "sha256:" + "0" * 64}
    image = ContainerImage.model_validate({
        "runtime_version": "4.3.1", "criu_version": "4.2.1", "mode": "exit", "archive_bytes": 1,
        "config": config, "gpu": record.model_dump(),
    })  # fmt: skip
    back = ContainerImage.from_meta(image.to_meta(), "file:///s/j/images/1")
    assert back.gpu == record  # the record survives the manifest

    new = _Driver(_host("GPU-b0", "GPU-b1", "GPU-b2"))
    there = ContainerGpu(_init(init), "podman:train", new)
    pairs = there.mapping(back.gpu)
    assert pairs == {"GPU-a0": "GPU-b0", "GPU-a1": "GPU-b1"}  # in order: the same indices
    new.states[init] = GpuState.CHECKPOINTED  # as podman's restore leaves the process
    assert await there.thaw(Timeline(), pairs) == [init]
    assert new.remaps == [pairs] and new.stuck() == {}
    # the same host: the same GPUs, identity pairs (as a process job's restore passes)
    assert ContainerGpu(_init(init), "podman:t", _Driver(old)).mapping(record) == {
        "GPU-a0": "GPU-a0", "GPU-a1": "GPU-a1"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("host", "says"),
    [
        (_host("GPU-b0", model="NVIDIA A10G"), "GPU model"),
        (_host("GPU-b0"), "GPU count"),
        (_host("GPU-b0", "GPU-b1", driver="570.1"), "NVIDIA driver major version"),
    ],
)
def test_other_gpus_that_cannot_take_the_container_are_refused_naming_both(
    host: GpuInventory, says: str
) -> None:
    record = ContainerGpu(_init(0), "podman:t", RecordingGpu(inventory=_host("GPU-a0", "GPU-a1")))
    record.inventory = _host("GPU-a0", "GPU-a1")
    image = record.record()
    with pytest.raises(MismatchError, match=says):
        ContainerGpu(_init(0), "podman:t", RecordingGpu(inventory=host)).mapping(image)


def test_an_image_without_gpu_state_maps_nothing() -> None:
    gpu = ContainerGpu(_init(0), "podman:t", RecordingGpu(inventory=_host("GPU-b0")))
    assert gpu.record() is None  # no freeze found GPU state: nothing recorded
    assert gpu.mapping(None) == {}
