"""The NVML adapter (:mod:`spotguard.nvml`) on a host without NVML: every query answers
"unavailable" (None) instead of raising, from any thread, and the callers built on it (park,
sizing, the GPU inventory) answer their "no GPU" values. A host with NVML is covered by
tests/gpu/test_gpu_nvml.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from spotguard import nvml, sizing
from spotguard.checkpoint import cuda
from spotguard.facts import GpuInventory
from spotguard.park import gpu


def _host_has_nvml() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - any failure means no NVML here
        return False
    return True


pytestmark = pytest.mark.skipif(_host_has_nvml(), reason="this host has NVML (tests/gpu)")


def test_every_query_answers_unavailable() -> None:
    assert nvml.available() is False
    assert nvml.gpus() is None
    assert nvml.driver_version() is None
    assert nvml.processes() is None
    assert nvml.sm_utilisation(0) is None
    assert nvml.inventory() == GpuInventory()


def test_callers_answer_no_gpu() -> None:
    me = [os.getpid()]
    assert gpu.free_bytes() is None
    assert gpu.total_bytes() is None
    assert gpu.used_bytes(me) == 0
    assert gpu.utilisation(me, 0) == 0.0
    assert gpu.devices() == []
    assert gpu.use_by_device(me) == {}
    assert sizing.gpu_bytes_by_pid(set(me)) == {}
    assert cuda.inventory() == GpuInventory()


def test_threads_ask_at_once() -> None:
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: (nvml.available(), nvml.gpus()), range(32)))
    assert answers == [(False, None)] * 32


def test_without_the_library() -> None:
    """``nvidia-ml-py`` not installed (the ``gpu`` extra left out): still no exception."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["pynvml"] = None  # import pynvml raises ImportError
        from spotguard import nvml
        print(nvml.available(), nvml.gpus(), nvml.processes(), nvml.inventory().count)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "None", "None", "0"]


def test_nvml_that_comes_up_after_the_agent_is_found_on_a_later_query() -> None:
    # an agent started at boot before the NVIDIA driver: the first answer is "unavailable",
    # a query after RETRY_AFTER_S initialises NVML again and finds it (a stand-in pynvml
    # module plays the NVIDIA library, whose driver appears between the two queries)
    code = textwrap.dedent(
        """
        import sys, types
        fake = types.ModuleType("pynvml")
        state = {"up": False}
        class NVMLError(Exception):
            pass
        def nvmlInit():
            if not state["up"]:
                raise NVMLError("Driver Not Loaded")
        fake.NVMLError = NVMLError
        fake.nvmlInit = nvmlInit
        fake.nvmlSystemGetDriverVersion = lambda: "580.159.04"
        sys.modules["pynvml"] = fake
        from spotguard import nvml
        nvml.RETRY_AFTER_S = 0.2
        first = nvml.available()
        state["up"] = True
        soon = nvml.available()
        import time
        time.sleep(0.3)
        print(first, soon, nvml.available(), nvml.driver_version())
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert done.stdout.split() == ["False", "False", "True", "580.159.04"], done.stderr
