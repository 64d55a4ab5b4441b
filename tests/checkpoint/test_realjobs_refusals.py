"""The freeze preflight refuses what CRIU cannot dump, at once and before any GPU lock or
CRIU run, with a message naming pid, process, resource and fix — and the job runs on and
ends exactly as an uninterrupted run (real processes, real CRIU on the engine)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import pytest
from ckpt_helpers import Launch, lines, proc_state, progresses, wait_exit, wait_for

from sgtest import sg_env
from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import resolve_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectoryTarget
from spotguard.checkpoint.testing import RecordingGpu
from spotguard.errors import UndumpableError

pytestmark = pytest.mark.criu

HOLD = str(Path(__file__).parent / "progs" / "hold.py")


class _NoLockCriu(Criu):
    """Real CRIU on a host where neither nftables nor iptables can lock connections."""

    async def network_locks(self) -> frozenset[str]:
        return frozenset()


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _expected(kind: str, steps: int) -> list[str]:
    return [*(f"step {i} {kind}" for i in range(1, steps + 1)), "done"]


async def test_cli_refuses_io_uring_with_its_message_and_the_job_runs_on(
    criu_bin: str, state_dir: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "SPOTGUARD_STATE_DIR": str(state_dir), "SPOTGUARD_CRIU": criu_bin}
    steps = 120
    out = sg_env("run", "--name", "uring", "--", sys.executable, HOLD, "uring", str(steps), "0.05",
               env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    job = resolve_job("uring", state_dir=state_dir)
    await wait_for(lambda: len(lines(job.dir / "stdout")) >= 2, "the job to start")
    (worker,) = proctree.tree(job.pid)[1:]
    name = _comm(worker)
    out = sg_env("checkpoint", "uring", "--to", str(tmp_path / "img"), env=env)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"spotguard: error: cannot checkpoint job 'uring': pid {worker} ({name}) holds an "
        "io_uring instance (fd 3, 4): CRIU cannot dump io_uring; PyTorch's TCPStore "
        "(torch.distributed rendezvous) holds one through libuv: start the job with "
        "'spotguard run' (it sets USE_LIBUV=0) or set USE_LIBUV=0 yourself; other programs "
        "must not use io_uring (the job keeps running)"
    )
    assert not (tmp_path / "img").exists()  # nothing was staged, nothing frozen
    assert proc_state(worker) in ("R", "S")
    await progresses(job.dir / "stdout")
    assert await wait_exit(job) == 0
    assert lines(job.dir / "stdout") == _expected("uring", steps)


@pytest.mark.parametrize(
    ("kind", "pattern"),
    [
        ("uring", r"holds an io_uring instance \(fd 3, 4\): CRIU cannot dump io_uring"),
        ("vsock", r"holds a socket of an unsupported family \(fd 3\)"),
        ("perf", r"holds anon_inode:\[perf_event\] \(fd 3\): CRIU cannot dump"),
        ("tcp", r"holds a TCP connection to 127\.0\.0\.1:\d+ outside the job \(fd 3\)"),
    ],
)
async def test_each_refusal_comes_before_any_gpu_lock_and_resumes_the_job(
    settings: CheckpointSettings,
    criu_bin: str,
    launch: Launch,
    tmp_path: Path,
    kind: str,
    pattern: str,
) -> None:
    if kind == "vsock":
        try:
            socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
        except OSError as exc:
            pytest.skip(f"no AF_VSOCK in this kernel: {exc}")
    server = socket.create_server(("127.0.0.1", 0))  # the peer outside the job ("tcp")
    port = str(server.getsockname()[1])
    gpu = RecordingGpu(lambda pids: list(pids[-1:]))  # the worker "holds GPU state"
    engine = Engine(_NoLockCriu(criu_bin), gpu, settings=settings)
    steps = 80
    try:
        job = await launch([sys.executable, HOLD, kind, str(steps), "0.05", port], kind)
        await wait_for(lambda: len(lines(job.dir / "stdout")) >= 2, "the job to start")
        with pytest.raises(UndumpableError, match=pattern) as err:
            await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        assert f"cannot checkpoint job '{kind}': pid " in str(err.value)
        spent = [op for op, _pid in gpu.calls if op != "state"]  # bring-back only asks
        assert spent == [], "no GPU lock may be spent on a dump that must fail"
        assert gpu.stuck() == {}
        assert not (tmp_path / "img").exists()
        assert not (job.dir / "operation.json").exists()
        await progresses(job.dir / "stdout")
        assert await wait_exit(job) == 0
        assert lines(job.dir / "stdout") == _expected(kind, steps)
    finally:
        server.close()


async def test_a_process_whose_session_leader_is_outside_its_pid_namespace_is_refused(
    settings: CheckpointSettings, criu_bin: str, state_dir: Path, tmp_path: Path
) -> None:
    """A process adopted by pid whose session began outside its PID namespace (a shell in
    a container started without setsid; CI runners) cannot be dumped: CRIU fails with "A
    session leader of N is outside of its pid namespace" even with --shell-job. The
    preflight says so in one line, with the fix, and the process runs on untouched."""
    outer = await asyncio.create_subprocess_exec(  # --kill-child: its sleep dies with it
        "unshare", "--pid", "--fork", "--kill-child", "sleep", "60"
    )
    try:
        await wait_for(lambda: len(proctree.tree(outer.pid)) == 2, "the process in its namespace")
        inner = proctree.tree(outer.pid)[1]
        job = resolve_job(inner, state_dir=state_dir)
        engine = Engine(Criu(criu_bin), RecordingGpu(lambda pids: []), settings=settings)
        with pytest.raises(UndumpableError, match="session leader is outside") as err:
            await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        assert "setsid" in str(err.value) and "\n" not in str(err.value)
        assert not (tmp_path / "img").exists()
        assert proc_state(inner) in {"S", "R"}
        assert outer.returncode is None
    finally:
        outer.kill()
        await outer.wait()
