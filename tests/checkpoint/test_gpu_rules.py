"""GPU rules that need no GPU: which processes are GPU processes (the driver's word, through
a stand-in for ``cuda.core.checkpoint.Process``), the UUID mapping a restore passes, GPU
count/model checks naming both sides, the host-subset choice, and the NCCL freeze rule
(a real process with NCCL "loaded" and an uncheckpointable environment)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.checkpoint.cuda import CudaHook, _Driver
from spotguard.checkpoint.nccl import env_problems, job_env, refuse_uncheckpointable
from spotguard.checkpoint.preflight import gpu_mapping
from spotguard.errors import GpuError, GpuUnsupportedError, MismatchError, PreflightError
from spotguard.facts import GpuDevice, GpuInventory

H100 = "NVIDIA H100 80GB HBM3"
U = [f"GPU-{i:08x}-1111-2222-3333-444444444444" for i in range(8)]


def inv(n: int, *, model: str = H100, driver: str = "580.159.04", first: int = 0) -> GpuInventory:
    return GpuInventory(
        tuple(GpuDevice(i, U[first + i], model, 80 << 30) for i in range(n)), driver
    )


class CUDAError(Exception):
    """Like cuda-core's: derives from Exception, not RuntimeError."""


class FakeProcess:
    """Answers like the driver: a CUDA process has a state; any other pid gets
    CUDA_ERROR_NOT_INITIALIZED (what a forked DataLoader worker gets)."""

    cuda: dict[int, str] = {}
    restored: list[tuple[int, dict[str, str] | None]] = []

    def __init__(self, pid: int) -> None:
        self.pid = pid

    @property
    def state(self) -> str:
        if self.pid not in self.cuda:
            raise CUDAError("CUDA_ERROR_NOT_INITIALIZED: This indicates that the CUDA driver")
        return self.cuda[self.pid]

    def lock(self, timeout_ms: int = 0) -> None:
        self.cuda[self.pid] = "locked"

    def checkpoint(self) -> None:
        self.cuda[self.pid] = "checkpointed"

    def restore(self, gpu_mapping: dict[str, str] | None = None) -> None:
        if gpu_mapping:
            for k in (*gpu_mapping, *gpu_mapping.values()):
                if len(k.replace("-", "")) != 32:  # what cuda-core itself insists on
                    raise ValueError(f"GPU UUID string must be 32 hex characters, got {k!r}")
        self.restored.append((self.pid, gpu_mapping))
        self.cuda[self.pid] = "locked"

    def unlock(self) -> None:
        self.cuda[self.pid] = "running"


@pytest.fixture
def hook() -> CudaHook:
    FakeProcess.cuda = {10: "running", 30: "locked"}
    FakeProcess.restored = []
    drv = _Driver(process=FakeProcess)
    return CudaHook(driver=lambda: drv)


async def test_a_checkpoint_the_driver_does_not_support_is_a_clear_final_error(
    hook: CudaHook,
) -> None:
    # the driver answers CUDA_ERROR_NOT_SUPPORTED for managed memory or CUDA IPC it cannot
    # move: not worth a retry; the message says what to change
    def refuse(self: FakeProcess) -> None:
        raise CUDAError("CUDA_ERROR_NOT_SUPPORTED: operation not supported")

    FakeProcess.cuda[10] = "locked"
    saved = FakeProcess.checkpoint
    FakeProcess.checkpoint = refuse  # type: ignore[method-assign]
    try:
        with pytest.raises(GpuUnsupportedError) as err:
            await hook.checkpoint([10])
    finally:
        FakeProcess.checkpoint = saved  # type: ignore[method-assign]
    assert not err.value.retryable
    assert "pid 10" in str(err.value) and "managed" in str(err.value)


async def test_gpu_processes_are_those_the_driver_knows(hook: CudaHook) -> None:
    # 20 is a forked worker (holds /dev/nvidia* fds, no context); 30 was restored and is
    # still locked (holds no device fd yet): the driver's word decides
    assert await hook.gpu_pids([10, 20, 30]) == [10, 30]


async def test_restore_passes_every_gpu_without_nvml_prefix(hook: CudaHook) -> None:
    mapping = gpu_mapping(inv(1), inv(1))  # one GPU onto itself: the remap path, identity
    assert mapping == {U[0]: U[0]}
    await hook.lock([10], 1.0)
    await hook.checkpoint([10])
    await hook.restore([10], mapping)
    assert FakeProcess.restored == [(10, {U[0][4:]: U[0][4:]})]
    await hook.unlock([10])
    assert FakeProcess.cuda[10] == "running"


class Refusing(FakeProcess):
    def lock(self, timeout_ms: int = 0) -> None:
        raise CUDAError("CUDA_ERROR_ILLEGAL_STATE")


async def test_a_driver_error_is_a_typed_error() -> None:
    drv = _Driver(process=Refusing)
    hook = CudaHook(driver=lambda: drv)
    with pytest.raises(GpuError, match=r"cuCheckpointProcessLock \(pid 99\)"):
        await hook.lock([99], 1.0)


class Rank(FakeProcess):
    """A rank of a collective job as the driver answers its lock: rank 11's next ``behind``
    locks end with NOT_READY at the driver's timeout (its submitted collective waits for a
    peer that is locked before launching its half); pid 12 is refused outright."""

    behind = 0
    tries: list[int] = []

    def lock(self, timeout_ms: int = 0) -> None:
        Rank.tries.append(self.pid)
        if self.pid == 11 and Rank.behind:
            Rank.behind -= 1
            raise CUDAError("CUDA_ERROR_NOT_READY: asynchronous operations not completed")
        if self.pid == 12:
            raise CUDAError("CUDA_ERROR_ILLEGAL_STATE")
        super().lock(timeout_ms)


def _ranks(behind: int) -> CudaHook:
    FakeProcess.cuda = {10: "running", 11: "running", 12: "running"}
    Rank.behind, Rank.tries = behind, []
    drv = _Driver(process=Rank)
    return CudaHook(driver=lambda: drv)


async def test_ranks_locked_in_attempts_never_left_half_locked() -> None:
    # the first two attempts find rank 11 waiting on rank 10: 10 is unlocked each time so
    # the ranks can meet, and the third attempt locks both
    hook = _ranks(behind=2)
    await hook.lock([10, 11], 5.0)
    assert FakeProcess.cuda == {10: "locked", 11: "locked", 12: "running"}
    assert sorted(Rank.tries) == [10, 10, 10, 11, 11, 11]
    # ranks that never meet: a typed error naming them, and neither is left locked
    hook = _ranks(behind=10**6)
    with pytest.raises(GpuError, match=r"GPU lock of 2 processes \(pids 10, 11\) not taken in"):
        await hook.lock([10, 11], 0.3)
    assert FakeProcess.cuda[10] == "running" and FakeProcess.cuda[11] == "running"
    # any other driver error ends it at once, the others unlocked
    hook = _ranks(behind=0)
    with pytest.raises(GpuError, match=r"cuCheckpointProcessLock \(pid 12\).*ILLEGAL_STATE"):
        await hook.lock([10, 12], 5.0)
    assert FakeProcess.cuda[10] == "running" and Rank.tries.count(10) == 1


def test_other_gpus_of_the_same_model_are_mapped_in_order() -> None:
    assert gpu_mapping(inv(2), inv(2, first=4)) == {U[0]: U[4], U[1]: U[5]}
    # the same GPUs in another order keep their own UUIDs
    swapped = GpuInventory((inv(2).devices[1], inv(2).devices[0]), "580.1")
    assert gpu_mapping(inv(2), swapped) == {U[0]: U[0], U[1]: U[1]}


def test_count_and_model_mismatches_name_both_sides() -> None:
    with pytest.raises(MismatchError, match=r"image has '2 x NVIDIA H100.*host has '1 x NVIDIA"):
        gpu_mapping(inv(2), inv(1, first=3))
    with pytest.raises(MismatchError, match=r"GPU model.*'NVIDIA H100.*'NVIDIA H200'"):
        gpu_mapping(inv(1), inv(1, model="NVIDIA H200"))
    with pytest.raises(MismatchError, match=r"driver major.*'580.159.04'.*'570.1'"):
        gpu_mapping(inv(1), inv(1, driver="570.1"))


def test_a_bigger_host_uses_a_chosen_subset() -> None:
    host = inv(8)
    img = inv(2, first=6)
    assert gpu_mapping(img, host) == {U[6]: U[6], U[7]: U[7]}  # its own GPUs are there
    assert gpu_mapping(img, host, ["3", U[1]]) == {U[6]: U[3], U[7]: U[1]}
    assert gpu_mapping(inv(2), inv(4, first=4)) == {U[0]: U[4], U[1]: U[5]}
    with pytest.raises(MismatchError, match="restore_gpus must name one host GPU per image"):
        gpu_mapping(img, host, ["3"])
    with pytest.raises(PreflightError, match="names GPU '9', which this host lacks"):
        gpu_mapping(img, host, ["3", "9"])
    with pytest.raises(PreflightError, match="names a GPU twice"):
        gpu_mapping(img, host, ["3", "3"])


def test_driver_570_restores_only_onto_the_same_gpus() -> None:
    old = "570.172.08"
    assert gpu_mapping(inv(1, driver=old), inv(1, driver=old)) == {}  # no pairs at all
    with pytest.raises(MismatchError, match=r"needs driver r580\+"):
        gpu_mapping(inv(1, driver=old), inv(1, driver=old, first=1))


def test_spotguard_run_env_keeps_the_users_choice_and_the_rule_names_it() -> None:
    env = job_env({"NCCL_P2P_DISABLE": "0", "PATH": "/bin"})
    assert env["NCCL_SHM_DISABLE"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
    assert env["NCCL_P2P_DISABLE"] == "0"
    assert [p.key for p in env_problems(env)] == ["NCCL_P2P_DISABLE"]
    assert env_problems({}) == []  # a single process: NCCL's defaults do no harm
    unset = env_problems({"WORLD_SIZE": "2"})  # a distributed one: they do
    assert "NCCL_SHM_DISABLE" in {p.key for p in unset}


def test_spotguard_run_keeps_a_jobs_ranks_on_loopback_unless_it_chose() -> None:
    # rank connections on the VM's own address restore only where that address exists
    env = job_env({"PATH": "/bin"})
    assert env["NCCL_SOCKET_IFNAME"] == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert job_env({"NCCL_SOCKET_IFNAME": "eth0"})["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env_problems({"WORLD_SIZE": "2", **job_env({"NCCL_SOCKET_IFNAME": "eth0"})}) == []


NCCL_USER = """
import mmap, os, sys, time
f = open(sys.argv[1], "rb")  # a library named like NCCL, mapped as the loader would
m = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)
print("ready", flush=True)
time.sleep(60)
"""


def test_freeze_rule_refuses_a_distributed_process_with_p2p_on(tmp_path: Path) -> None:
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"\0" * 4096)
    env = job_env({"WORLD_SIZE": "2", "NCCL_P2P_DISABLE": "0"})
    proc = subprocess.Popen(
        [sys.executable, "-c", NCCL_USER, str(lib)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        with pytest.raises(
            PreflightError,
            match=rf"pid {proc.pid} \(python[^)]*\): NCCL_P2P_DISABLE=0 \(set NCCL_P2P_DISABLE=1",
        ):
            refuse_uncheckpointable("j", [proc.pid])
        refuse_uncheckpointable("j", [])  # no GPU process: nothing to refuse
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.criu
async def test_a_refused_freeze_leaves_the_job_running_untouched(
    criu_bin: str, tmp_path: Path
) -> None:
    from ckpt_helpers import progresses, wait_for

    from spotguard.checkpoint import proctree
    from spotguard.checkpoint.criu import Criu
    from spotguard.checkpoint.engine import Engine, Mode
    from spotguard.checkpoint.jobs import start_job
    from spotguard.checkpoint.settings import CheckpointSettings
    from spotguard.checkpoint.staging import DirectoryTarget
    from spotguard.checkpoint.testing import RecordingGpu

    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"\0" * 4096)
    script = tmp_path / "ddp_like.py"
    script.write_text(
        NCCL_USER.replace(
            "time.sleep(60)", "[print(i, flush=True) or time.sleep(0.05) for i in range(2000)]"
        )
    )
    settings = CheckpointSettings(state_dir=tmp_path / "state", criu=criu_bin)
    gpu = RecordingGpu(select=lambda pids: list(pids[1:2]))  # the command, not the init
    engine = Engine(Criu(criu_bin), gpu, settings=settings)
    job = await start_job(
        [sys.executable, str(script), str(lib)],
        "nccl-p2p",
        state_dir=settings.state_dir,
        env={**os.environ, "WORLD_SIZE": "2", "NCCL_P2P_DISABLE": "0"},
    )
    try:
        out = job.dir / "stdout"
        await wait_for(lambda: out.exists() and len(out.read_text().splitlines()) > 3, "output")
        with pytest.raises(PreflightError, match="NCCL_P2P_DISABLE=0"):
            await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        assert [c for c, _ in gpu.calls if c != "state"] == []  # refused before any GPU lock
        assert gpu.stuck() == {}
        assert not (tmp_path / "img" / "spotguard-image.json").exists()
        await progresses(out)  # still running
    finally:
        proctree.signal_all([job.pid], signal.SIGKILL)
