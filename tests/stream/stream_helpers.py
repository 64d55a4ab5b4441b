"""Shared pieces of the streaming tests: the deterministic job and waiting for its output
(the store that holds chunks back, ``GatedStore``, is the whole suite's: :mod:`sgtest`)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import psutil

from spotguard.checkpoint.jobs import JobInfo, start_job

#: A job whose output depends on every step and on memory it filled at start: if a restore
#: lost or corrupted anything, the printed hashes differ from an uninterrupted run.
JOB = """
import hashlib, random, sys, time
steps, mib = int(sys.argv[1]), int(sys.argv[2])
r = random.Random(7)
blob = bytearray().join(r.randbytes(1 << 20) for _ in range(mib))
h = hashlib.sha256()
for i in range(steps):
    h.update(blob[(i * 65536) % len(blob):][:4096]); h.update(str(i).encode())
    print(i, h.hexdigest()[:16], flush=True)
    time.sleep(0.03)
print("done", flush=True)
"""
STEPS = 60
MIB = 48


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


async def wait_lines(path: Path, n: int, limit: float = 30.0) -> None:
    """Wait until the file at ``path`` holds at least ``n`` lines."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while loop.time() < end:
        if (await asyncio.to_thread(_read, path)).count("\n") >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{path} did not reach {n} lines")


async def wait_done(path: Path, limit: float = 30.0) -> str:
    """Wait for the job's last line and return its whole output."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    text = ""
    while loop.time() < end:
        text = await asyncio.to_thread(_read, path)
        if text.endswith("done\n"):
            return text
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} never finished: {text[-200:]!r}")


async def start_stream_job(job_script: Path, state_dir: Path, name: str) -> JobInfo:
    """The deterministic job under ``spotguard run``'s namespaces, once it has printed a few
    steps (its memory filled)."""
    job = await start_job(
        [sys.executable, str(job_script), str(STEPS), str(MIB)], name, state_dir=state_dir
    )
    await wait_lines(job.dir / "stdout", 5)
    return job


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it (those already gone are skipped)."""
    with contextlib.suppress(psutil.Error):
        for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                p.kill()
