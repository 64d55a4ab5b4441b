"""Fixtures for the NCCL shim's CPU tests: the shim built by its real installer against the
test copy of nccl.h, a fake libnccl.so.2 and libcuda.so.1 (test doubles of NVIDIA's
libraries, CPU only) and a multi-rank job linked to them as PyTorch links NCCL."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))

from ckpt_helpers import Launch

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, list_jobs, start_job

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
HEADER = HERE / "include" / "nccl.h"


@dataclass(frozen=True)
class Built:
    """The shim and the test doubles, built once per session."""

    shim: Path
    fakes: Path  # libnccl.so.2, libcuda.so.1
    job: Path  # the nccl_job binary

    def env(self, work: Path, **extra: str) -> dict[str, str]:
        """The job's environment: the fakes found first, their files under ``work``."""
        return {
            **os.environ,
            "LD_LIBRARY_PATH": str(self.fakes),
            "FAKE_NCCL_DIR": str(work),
            "FAKE_NCCL_LOG": str(work / "nccl.log"),
            **extra,
        }


def _cc(*args: str) -> None:
    done = subprocess.run(["cc", "-std=gnu11", "-O2", "-Wall", *args], capture_output=True,
                          text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"cc {' '.join(args)}: {done.stderr[-2000:]}")


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    out = tmp_path_factory.mktemp("nccl-shim")
    env = {**os.environ, "SPOTGUARD_NCCL_SHIM_PREFIX": str(out / "prefix"),
           "SPOTGUARD_NCCL_H": str(HEADER), "PYTHON": sys.executable}  # fmt: skip
    done = subprocess.run([str(ROOT / "scripts" / "install-nccl-shim")], env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    shim = Path(done.stdout.strip().splitlines()[-1])
    fakes = out / "fakes"
    fakes.mkdir()
    src = HERE / "csrc"
    inc = f"-I{HERE / 'include'}"
    _cc("-fPIC", "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(fakes / "libcuda.so.1"),
        str(src / "fake_cuda.c"))  # fmt: skip
    _cc("-fPIC", "-shared", "-Wno-format-truncation", "-Wl,-soname,libnccl.so.2", inc, "-o",
        str(fakes / "libnccl.so.2"), str(src / "fake_nccl.c"), f"-L{fakes}",
        "-l:libcuda.so.1")  # fmt: skip
    _cc(inc, "-o", str(out / "nccl_job"), str(src / "job.c"), f"-L{fakes}", "-l:libnccl.so.2",
        "-l:libcuda.so.1", "-lpthread")  # fmt: skip
    return Built(shim, fakes, out / "nccl_job")


@pytest.fixture
async def launch_shim(built: Built, tmp_path: Path) -> AsyncIterator[Launch]:
    """Start jobs with ``spotguard run``'s NCCL release settings (the shim preloaded)."""
    state = tmp_path / "state"

    async def _launch(argv: list[str], name: str, env: dict[str, str] | None = None) -> JobInfo:
        return await start_job(argv, name, state_dir=state, env=env or built.env(tmp_path),
                               nccl_shim=built.shim)  # fmt: skip

    yield _launch
    for job in list_jobs(state):
        if proctree.alive(job.pid):
            proctree.signal_all([job.pid], __import__("signal").SIGKILL)
