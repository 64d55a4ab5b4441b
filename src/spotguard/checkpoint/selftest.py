"""``spotguard doctor``'s self-test: park and unpark a small real job on this host.

Why: ``criu check`` says the kernel has CRIU's features, not that a job with sockets comes
back. The self-test starts :mod:`.selftest_job` (two processes: a listening TCP socket, an
established loopback connection between them, a socketpair) exactly as ``spotguard run``
does, freezes it in exit mode through the real engine into a temporary directory, restores
it at once and checks that its output is exactly what an uninterrupted run prints. A
failure becomes a :class:`SelfTestResult` saying what went wrong and what to do
(:func:`advice`), never a traceback. Everything it made is removed, and a job left running
is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spotguard.errors import CriuError, SpotguardError, StepTimeout, UndumpableError
from spotguard.statedir import StateDir

from . import proctree, selftest_job
from .criu import MIN_VERSION_TEXT, Criu
from .cuda import NoGpu
from .engine import Engine, Mode
from .jobs import JOB_FILE, JobInfo, exit_status, start_job
from .scan import NetworkLock, job_environment
from .settings import CheckpointSettings
from .staging import DirectorySource, DirectoryTarget

STEPS = 60
STEP_SECONDS = 0.05
JOB_NAME = "spotguard-selftest"


@dataclass(frozen=True)
class SelfTestResult:
    """The outcome: ``found`` says what happened, ``fix`` what to do when it failed."""

    ok: bool
    found: str
    fix: str = ""


#: (text in the error or CRIU's log, what to do), first match wins
_ADVICE: tuple[tuple[str, str], ...] = (
    (
        "opt: Operation not supported",
        f"this CRIU cannot dump inet sockets on this kernel: install CRIU >= "
        f"{MIN_VERSION_TEXT} with scripts/install-criu",
    ),
    (
        "Iptables configuration failed",
        "CRIU's network lock needs iptables, which is missing: enable nf_tables in the kernel "
        '(network_lock = "nftables") or install iptables',
    ),
    (
        "Failed to lock TCP connection",
        "CRIU could not lock the job's TCP connections: enable nf_tables or install iptables",
    ),
    (
        "Can't fork for",
        "a PID the image needs is taken: jobs need their own PID namespace (run as root, "
        "kernel with user/PID namespaces)",
    ),
    (
        "unshare(CLONE_NEWPID)",
        "the job could not get its own PID namespace: run as root",
    ),
    (
        "has bad size",
        "a file the job writes changed between dump and restore: report this as a bug",
    ),
    (
        "nftables",
        "CRIU's nftables network lock failed: check that the nf_tables kernel module loads, "
        'or install iptables and set network_lock = "iptables"',
    ),
)


def advice(error: BaseException) -> str:
    """What to do about a self-test failure, from its message and CRIU's log tail."""
    text = str(error)
    if isinstance(error, CriuError):
        text += "\n" + error.log_tail
    for needle, fix in _ADVICE:
        if needle in text:
            return fix
    if isinstance(error, StepTimeout):
        return "CRIU ran past its time limit: run 'criu check --all' and look for hung tasks"
    if isinstance(error, CriuError) and error.log_path:
        return f"read CRIU's log {error.log_path} and run 'criu check --all' as root"
    return "run 'criu check --all' as root and 'spotguard doctor' again"


async def _wait(cond: Callable[[], bool], what: str, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {limit:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


def _lines(job: JobInfo) -> int:
    try:
        return len((job.dir / "stdout").read_text().splitlines())
    except OSError:
        return 0


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


async def _round_trip(criu: Criu, work: Path, network_lock: NetworkLock) -> str:
    """Start, freeze (exit), restore and finish the job; what the dump did."""
    settings = CheckpointSettings(
        state_dir=work / "state",
        criu=criu.path,
        shm_dir=work / "shm",
        criu_timeout=60,
        pid_wait=10,
        network_lock=network_lock,
    )
    engine = Engine(criu, NoGpu(), settings=settings)
    argv = [sys.executable, "-I", selftest_job.__file__, str(STEPS), str(STEP_SECONDS)]
    env = job_environment(os.environ)
    job = await start_job(argv, JOB_NAME, state_dir=settings.state_dir, env=env)
    await _wait(lambda: _lines(job) >= 3 or exit_status(job) is not None, "the job", 30)
    if exit_status(job) is not None:
        err = (job.dir / "stderr").read_text(errors="replace").strip()
        raise RuntimeError(f"the self-test job ended before its checkpoint: {err[-300:]}")
    pids = proctree.tree(job.pid)
    frozen = await engine.freeze(job, DirectoryTarget(work / "image"), Mode.EXIT)
    await _wait(lambda: not any(proctree.alive(p) for p in pids), "the job to stop", 30)
    restored = await engine.restore(DirectorySource(work / "image"))
    await _wait(lambda: exit_status(restored.job) is not None, "the restored job to end", 60)
    out = (job.dir / "stdout").read_text(errors="replace")
    if exit_status(restored.job) != 0 or out != selftest_job.expected(STEPS):
        raise RuntimeError(
            f"the restored job's output differs from an uninterrupted run's (exit "
            f"{exit_status(restored.job)}, {len(out.splitlines())} lines)"
        )
    scan = next((s for s in frozen.timeline.steps if s.name == "scan"), None)
    lock = scan.detail.get("network_lock") if scan else None
    return f"network lock {lock}, paused {frozen.pause_seconds:.2f} s"


async def _kill_leftovers(work: Path) -> None:
    """Kill what is left of the self-test job and wait (up to 10 s) until it is gone: a
    killed process takes a moment to exit, and doctor must leave nothing running."""
    job_file = StateDir(work / "state").job(JOB_NAME) / JOB_FILE
    if not job_file.exists():
        return
    pids: list[int] = []
    with contextlib.suppress(SpotguardError, OSError, ValueError, KeyError):
        pid = int(json.loads(job_file.read_text())["pid"])
        if proctree.alive(pid):
            pids = proctree.tree(pid)
            proctree.signal_all(pids, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        await _wait(lambda: not any(proctree.alive(p) for p in pids), "the job to go", 10)


async def run_selftest(criu: Criu, *, network_lock: NetworkLock = "auto") -> SelfTestResult:
    """Park and unpark the self-test job on this host; never raises for a failed round."""
    work = Path(tempfile.mkdtemp(prefix="spotguard-selftest-"))
    what = (
        "a 2-process job with a listening TCP socket, an established loopback connection "
        "and a socketpair"
    )
    try:
        done = await _round_trip(criu, work, network_lock)
        return SelfTestResult(True, f"dumped and restored {what}; output exact ({done})")
    except UndumpableError as exc:
        return SelfTestResult(False, f"refused: {_first_line(exc)}", advice(exc))
    except (SpotguardError, OSError, RuntimeError, TimeoutError) as exc:
        return SelfTestResult(False, f"failed: {_first_line(exc)}", advice(exc))
    finally:
        await _kill_leftovers(work)
        shutil.rmtree(work, ignore_errors=True)
