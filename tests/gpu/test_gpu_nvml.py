"""The NVML adapter (:mod:`spotguard.nvml`) on a host with GPUs (device machine:
scripts/gpu-tests): its inventory and per-process memory agree with what NVML's own bindings
answer, from several threads at once, and park's and the planner's views built on it see a
real CUDA process's memory."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from spotguard import nvml, sizing
from spotguard.park import gpu

pytestmark = pytest.mark.gpu

HOLD = 1 << 30  # bytes the CUDA process allocates

_JOB = f"""
import sys, time, torch
x = torch.ones({HOLD}, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def holder() -> Iterator[int]:
    if not nvml.available():
        pytest.skip("needs NVML (an NVIDIA driver and nvidia-ml-py)")
    p = subprocess.Popen(
        [sys.executable, "-c", _JOB], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    yield p.pid
    p.kill()
    p.wait()


def _direct() -> list[tuple[str, str, int]]:
    import pynvml

    pynvml.nvmlInit()
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        uuid, name = pynvml.nvmlDeviceGetUUID(h), pynvml.nvmlDeviceGetName(h)
        out.append((str(uuid), str(name), int(pynvml.nvmlDeviceGetMemoryInfo(h).total)))
    return out


def test_inventory_matches_nvml(holder: int) -> None:
    found = nvml.gpus()
    assert found is not None and found
    assert [(g.uuid, g.name, g.memory_total) for g in found] == _direct()
    assert all(0 < g.memory_free <= g.memory_total for g in found)
    inv = nvml.inventory()
    assert inv.count == len(found) and inv.driver == nvml.driver_version()
    assert [d.uuid for d in inv.devices] == [g.uuid for g in found]


def test_process_memory_seen_by_callers(holder: int) -> None:
    procs = [p for p in nvml.processes() or () if p.pid == holder]
    assert procs and sum(p.used for p in procs) >= HOLD
    assert gpu.used_bytes([holder]) >= HOLD
    assert sum(gpu.use_by_device([holder]).values()) == gpu.used_bytes([holder])
    assert sizing.gpu_bytes_by_pid({holder})[holder] == gpu.used_bytes([holder])
    est = sizing.estimate(holder)  # the planner's: NVML asked, the job has a GPU open
    assert est.gpu_bytes == gpu.used_bytes([holder]) and est.source == "nvml+psutil"
    free, total = gpu.free_bytes(), gpu.total_bytes()
    assert free is not None and total is not None and free < total


def test_threads_ask_at_once(holder: int) -> None:
    with ThreadPoolExecutor(8) as pool:
        seen = list(pool.map(lambda _: gpu.used_bytes([holder]), range(32)))
    assert min(seen) >= HOLD
