"""Touch the host's free memory once, at the agent's start, so that a later freeze or restore
finds guest pages the hypervisor has already backed.

On the lent GPU VMs guest memory touched for the first time is made at 2.7-5.5 GB/s against
about 8 GB/s after (``bench.firsttouch``), and a freeze is mostly fresh pages: the driver's
staging of the GPU memory, the image's pages in a tmpfs store. The first 40 GiB freeze on a
fresh VM took 21.7-26.2 s against 13.3-15.9 s once 128 GiB had been touched first
(docs/benchmarks.md, "the VM's first touch"). The agent pays that once, in the background,
instead of the first checkpoint paying it against a two-minute notice.

It runs as a child process (``python -m spotguard.warm``) that sets its own
``oom_score_adj`` to 1000 first: under memory pressure the kernel ends it, never the job or
the agent. It maps pieces of anonymous memory and populates them (``MADV_POPULATE_WRITE``)
with a few threads while ``MemAvailable`` stays above a margin, holds them all - a page freed
is the next one a piece reuses, so touching all of it needs all of it at once - then exits,
which returns every page to the guest. It runs once per boot, after the agent's boot restore
(both would share the VM's page rate), and gives its memory back at once when a freeze or
restore takes its crash marker meanwhile (a marker whose writer is gone - a leftover that
recovery could not clear - is not work in progress, and holds nothing back).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import glob
import json
import logging
import mmap
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from spotguard import safefs
from spotguard.checkpoint.marker import writer_alive
from spotguard.checkpoint.procfacts import start_time
from spotguard.errors import ConfigError, SpotguardError
from spotguard.madvise import populate_split
from spotguard.sizing import meminfo

log = logging.getLogger(__name__)

PIECE = 1 << 30
HUGE = 2 << 20
GPU_NODE = Path("/dev/nvidiactl")
#: memory left untouched: the larger of this and a tenth of the host's
MARGIN_MIN = 8 << 30
#: the warm-up's own limit (seconds): a VM whose memory is this slow stops early
LIMIT_S = 600.0


@dataclass(frozen=True)
class Warmed:
    """What a warm-up did: bytes touched, seconds, threads, and its ``oom_score_adj``."""

    bytes: int
    seconds: float
    threads: int
    oom_score_adj: int


def parse_setting(value: str) -> float | None:
    """``[agent] warm_memory``: ``auto`` (None: as much as is free, on a host with an NVIDIA
    GPU), ``off`` (0), or GiB to touch at most. :class:`ConfigError` for anything else."""
    v = value.strip().lower()
    if v == "auto":
        return None
    if v in ("off", "0", "no", "false"):
        return 0.0
    try:
        gib = float(v)
    except ValueError:
        gib = -1.0
    if gib < 0:
        raise ConfigError(f"warm_memory must be 'auto', 'off' or GiB (a number), not {value!r}")
    return gib


def margin() -> int:
    """Bytes a warm-up leaves free: a tenth of the host's memory, at least 8 GiB."""
    return max(MARGIN_MIN, meminfo().get("MemTotal", 0) // 10)


def plan(want: int | None, available: int, keep: int) -> int:
    """Bytes to touch: ``want`` (None: all there is) within what leaves ``keep`` available,
    in whole huge pages."""
    room = max(0, available - keep)
    n = room if want is None else min(want, room)
    return n // HUGE * HUGE


def touch(
    total: int,
    threads: int,
    keep: int,
    busy: Callable[[], bool] = lambda: False,
    limit_s: float = LIMIT_S,
    piece: int = PIECE,
) -> tuple[int, float]:
    """Populate up to ``total`` bytes a piece at a time, each piece held until the end,
    stopping early when ``MemAvailable`` falls under ``keep``, when ``busy()`` (a freeze or
    restore has begun: it needs the memory now) or after ``limit_s``; the bytes touched and
    the seconds taken. Every piece is unmapped before this returns."""
    held: list[mmap.mmap] = []
    done = 0
    t0 = time.perf_counter()
    try:
        while done < total and time.perf_counter() - t0 < limit_s:
            size = min(piece, total - done)
            if meminfo().get("MemAvailable", 0) - size < keep or busy():
                break
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            held.append(m)
            anchor = ctypes.c_char.from_buffer(m)
            try:
                populate_split(ctypes.addressof(anchor), size, threads)
            finally:
                del anchor
            done += size
    finally:
        for m in held:
            m.close()
    return done, time.perf_counter() - t0


PR_SET_PDEATHSIG = 1


def _in_progress(path: str) -> bool:
    """Whether the crash marker at ``path`` belongs to a freeze or restore still running:
    its writer (``agent_pid`` and ``agent_start``, :mod:`spotguard.checkpoint.marker`) is
    alive. One that cannot be read, or names no writer, is not."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return writer_alive(data)


@contextlib.contextmanager
def holding_back(directory: Path) -> Iterator[None]:
    """While the block runs, a record in ``directory`` that this process is busy (its pid
    and start time, the crash marker's fields :func:`_in_progress` reads): work without an
    engine crash marker - a container's checkpoint or restore - holds the warm-up back with
    it. Never fails the work: a record that cannot be written is logged and skipped."""
    path = directory / f"{os.getpid()}-{start_time('self') or 0}-{uuid.uuid4().hex[:8]}.json"
    record = {"agent_pid": os.getpid(), "agent_start": start_time("self")}
    try:
        safefs.ensure_private_dir(directory)
        safefs.write_file(path, json.dumps(record).encode(), mode=0o600)
    except (OSError, SpotguardError) as exc:
        log.debug("no busy record for the warm-up", extra={"path": str(path), "error": str(exc)})
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _child(want: int | None, threads: int, busy_globs: list[str]) -> Warmed:
    # ends with the agent that started it, even one killed with SIGKILL
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    Path("/proc/self/oom_score_adj").write_text("1000")
    adj = int(Path("/proc/self/oom_score_adj").read_text())
    keep = margin()
    total = plan(want, meminfo().get("MemAvailable", 0), keep)

    def busy() -> bool:
        return any(_in_progress(p) for pattern in busy_globs for p in glob.glob(pattern))

    touched, seconds = touch(total, threads, keep, busy)
    return Warmed(touched, round(seconds, 3), threads, adj)


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _remember(record: Path) -> None:
    record.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    safefs.write_atomic(record, (_boot_id() + "\n").encode())


def _done_this_boot(record: Path) -> bool:
    try:
        return record.read_text().strip() == _boot_id()
    except OSError:
        return False


def default_threads() -> int:
    """Half the cores, at most 8: making fresh pages peaks at 8-16 threads on the lent VMs."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


async def warm_host(setting: str, record: Path, busy_globs: list[str]) -> Warmed | None:
    """The agent's warm-up for ``[agent] warm_memory`` (see :func:`parse_setting`), in a
    child process, once per boot (``record`` holds the boot's id after it); None when off,
    done already, or ``auto`` on a host without an NVIDIA GPU. The child stops and returns
    its memory as soon as a file matches one of ``busy_globs`` (the engine's crash markers:
    a freeze or restore began) or this task is cancelled. Logged; a failure is logged, never
    raised: it is an optimisation."""
    gib = parse_setting(setting)
    if gib == 0.0 or (gib is None and not await asyncio.to_thread(GPU_NODE.exists)):
        return None
    if await asyncio.to_thread(_done_this_boot, record):
        return None
    argv = [sys.executable, "-m", "spotguard.warm", "--threads", str(default_threads())]
    argv += ["--gib", str(gib)] if gib is not None else []
    for pattern in busy_globs:
        argv += ["--busy", pattern]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise
        if proc.returncode != 0:
            said = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise OSError(f"exit status {proc.returncode}: {said[0]}")
        warmed = Warmed(**json.loads(out.decode().strip().splitlines()[-1]))
        await asyncio.to_thread(_remember, record)
    except (OSError, ValueError, TypeError) as exc:
        log.warning("host memory not warmed", extra={"step": "start", "error": str(exc)})
        return None
    log.info(
        "host memory warmed",
        extra={"step": "start", "bytes": warmed.bytes, "seconds": warmed.seconds},
    )
    return warmed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--gib", type=float, default=None, help="at most this much (default: all)")
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--busy", action="append", default=[], help="stop once a file matches")
    args = ap.parse_args(argv)
    want = None if args.gib is None else int(args.gib * (1 << 30))
    print(json.dumps(asdict(_child(want, max(1, args.threads), args.busy))), flush=True)


if __name__ == "__main__":
    main()
