"""NCCL at full speed on one GPU (device machine: ``scripts/gpu-tests``, which builds the NCCL
shim against the nccl.h of PyTorch's NCCL and exports ``SPOTGUARD_NCCL_SHIM``).

A single-rank torch.distributed job on the NCCL backend (a communicator of one) with NCCL's
default transports — ``spotguard run`` sets none of the switches, it preloads spotguard's
shim — goes through a leave-running checkpoint, an exit checkpoint and a restore; its
communicator is released before each freeze and rebuilt after (the timelines, from the log
lines "NCCL communicators released/rebuilt"), and its output is byte-identical to an
uninterrupted run's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_gpu_realjobs import JOBS, Spotguard, gpu_mib_used, lines, wait

from sgtest import free_port
from spotguard.checkpoint import proctree
from spotguard.checkpoint.cuda import driver_available, inventory
from spotguard.checkpoint.ncclctl import shim_loaded
from spotguard.checkpoint.procfacts import read_environ
from spotguard.checkpoint.settings import CheckpointSettings

pytestmark = [pytest.mark.gpu, pytest.mark.criu]


def installed_shim() -> Path:
    """The NCCL shim ``spotguard run`` preloads. Called once a GPU is known to be there, where
    scripts/gpu-tests has built it: its absence is a broken install, so the test fails."""
    shim = Path(os.environ.get("SPOTGUARD_NCCL_SHIM") or CheckpointSettings().nccl_shim)
    if not shim.is_file():
        pytest.fail(f"no NCCL shim at {shim}: scripts/install-nccl-shim did not build it")
    return shim


def nccl_step(result: dict[str, Any], name: str) -> int:
    """How many communicators the freeze or restore released or rebuilt (its timeline)."""
    detail: dict[str, Any] = next(t for t in result["timeline"] if t["name"] == name)["detail"]
    return int(detail.get("communicators", 0))


def test_a_single_rank_nccl_job_with_default_transports_is_released_and_rebuilt(
    tmp_path: Path, criu_bin: str
) -> None:
    if not driver_available() or not inventory().count:
        pytest.skip("needs an NVIDIA GPU with the driver checkpoint API")
    shim = installed_shim()
    steps = 160
    argv = [sys.executable, str(JOBS / "ddp_nccl.py"), str(steps), "0.05", str(free_port()), "1"]
    sg = Spotguard(tmp_path, criu_bin, {"SPOTGUARD_NCCL_SHIM": str(shim)})
    ref = subprocess.run(argv, env=sg.env, capture_output=True, text=True, timeout=600,
                         check=False)  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = ref.stdout.splitlines()
    assert len(want) == steps
    job = sg.run("nccl1", argv)
    out = Path(job["dir"]) / "stdout"
    err = Path(job["dir"]) / "stderr"
    try:
        wait(lambda: len(lines(out)) >= 5, "the NCCL job to start")
        ranks = [p for p in proctree.tree(job["pid"]) if shim_loaded(p)]
        assert ranks, "the shim is not loaded"
        assert not any("NCCL_P2P_DISABLE" in read_environ(p) for p in ranks)
        paused = sg("checkpoint", "nccl1", "--to", str(sg.root / "img-pause"), "--leave-running")
        assert nccl_step(paused, "nccl_release") == 1, paused["timeline"]
        assert nccl_step(paused, "nccl_rebuild") == 1, paused["timeline"]
        n = len(lines(out))
        wait(lambda: len(lines(out)) > n + 3, "the job to go on after the pause")
        parked = sg("checkpoint", "nccl1", "--to", str(sg.root / "img-park"))
        assert nccl_step(parked, "nccl_release") == 1
        wait(lambda: not proctree.alive(job["pid"]), "the job to stop")
        assert gpu_mib_used() == 0, "GPU memory still held while parked"
        assert len(lines(out)) < steps, "the job ended before it was parked"
        restored = sg("restore", str(sg.root / "img-park"))
        assert nccl_step(restored, "nccl_rebuild") == 1
        wait(lambda: (Path(job["dir"]) / "exit_status").exists(), "the job to finish", 600)
        assert (Path(job["dir"]) / "exit_status").read_text().strip() == "0", err.read_text()
        assert lines(out) == want
        print(
            f"\nnccl x1 (NCCL defaults, shim): pause {paused['pause_seconds']:.2f} s "
            f"({sg.steps(paused)}); park: {sg.steps(parked)}; unpark: {sg.steps(restored)}; "
            f"output byte-identical ({len(want)} lines)"
        )
    except BaseException:
        print("nccl1 stderr:", err.read_text()[-4000:] if err.exists() else "(none)")
        raise
    finally:
        sg.kill_all()
