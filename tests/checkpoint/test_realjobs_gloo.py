"""A 2-rank torch.distributed job over gloo (CPU) started with ``spotguard run`` and no
change to its code: parked and unparked back to back with no flags, output exact; with
libuv's TCPStore forced back on (USE_LIBUV=1) the preflight refuses its io_uring by name and
the job runs on (real CRIU, real PyTorch).

Needs an interpreter with PyTorch: ``SPOTGUARD_TEST_TORCH_PYTHON``, else this one when it
imports torch; skipped otherwise (the project's test environment does not install PyTorch).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_helpers import lines, progresses, wait_exit, wait_for

from sgtest import free_port as _free_port
from sgtest import sg_env
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import resolve_job

pytestmark = [pytest.mark.criu, pytest.mark.slow]

JOB = str(Path(__file__).parent / "progs" / "gloo_job.py")
STEPS = 300


def _torch_python() -> str:
    explicit = os.environ.get("SPOTGUARD_TEST_TORCH_PYTHON")
    candidates = [explicit] if explicit else [sys.executable]
    for py in candidates:
        if py and shutil.which(py):
            probe = subprocess.run([py, "-c", "import torch.distributed"], capture_output=True)
            if probe.returncode == 0:
                return py
    pytest.skip("no interpreter with PyTorch (set SPOTGUARD_TEST_TORCH_PYTHON)")


def _expected(steps: int) -> list[str]:
    out, total = [], [0.0] * 4
    for i in range(1, steps + 1):
        x = [float(3 * k + 2 * i) for k in range(4)]  # rank 0 + rank 1 contributions
        total = [a + b for a, b in zip(total, x, strict=True)]
        out.append(f"step {i} {x} {total}")
    return [*out, "done"]


def _env(criu_bin: str, state_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "USE_LIBUV"}
    return {**env, "SPOTGUARD_STATE_DIR": str(state_dir), "SPOTGUARD_CRIU": criu_bin, **extra}


def _argv(py: str) -> list[str]:
    return [py, "-W", "ignore", JOB, str(_free_port()), str(STEPS), "0.05"]


async def test_two_rank_gloo_job_parks_and_unparks_with_no_flags(
    criu_bin: str, state_dir: Path, tmp_path: Path
) -> None:
    py = _torch_python()
    env = _env(criu_bin, state_dir)
    out = sg_env("run", "--name", "gloo", "--", *_argv(py), env=env)
    assert out.returncode == 0, out.stderr
    job = resolve_job("gloo", state_dir=state_dir)
    await wait_for(lambda: len(lines(job.dir / "stdout")) >= 20, "twenty steps", 120)
    pids = proctree.tree(job.pid)
    out = sg_env("checkpoint", "gloo", "--to", str(tmp_path / "img"), "--json", env=env)
    assert out.returncode == 0, out.stderr
    (scan,) = [s for s in json.loads(out.stdout)["timeline"] if s["name"] == "scan"]
    assert scan["detail"]["tcp_connections"] >= 2 and scan["detail"]["tcp_external"] == 0
    await wait_for(lambda: not any(proctree.alive(p) for p in pids), "the job to stop")
    out = sg_env("restore", str(tmp_path / "img"), env=env)
    assert out.returncode == 0, out.stderr
    assert await wait_exit(resolve_job("gloo", state_dir=state_dir), 180) == 0
    assert lines(job.dir / "stdout") == _expected(STEPS)


async def test_gloo_job_with_libuv_store_is_refused_by_name_and_runs_on(
    criu_bin: str, state_dir: Path, tmp_path: Path
) -> None:
    py = _torch_python()
    env = _env(criu_bin, state_dir, USE_LIBUV="1")  # the caller's choice wins
    out = sg_env("run", "--name", "gloo-uv", "--", *_argv(py), env=env)
    assert out.returncode == 0, out.stderr
    job = resolve_job("gloo-uv", state_dir=state_dir)
    await wait_for(lambda: len(lines(job.dir / "stdout")) >= 20, "twenty steps", 120)
    out = sg_env("checkpoint", "gloo-uv", "--to", str(tmp_path / "img"), env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    last = out.stderr.splitlines()[-1]
    assert last.startswith("spotguard: error: cannot checkpoint job 'gloo-uv': pid ")
    assert "holds an io_uring instance" in last and "set USE_LIBUV=0" in last
    assert not (tmp_path / "img").exists()
    await progresses(job.dir / "stdout")
    assert await wait_exit(job, 180) == 0
    assert lines(job.dir / "stdout") == _expected(STEPS)
