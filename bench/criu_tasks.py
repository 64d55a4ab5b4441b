"""CRIU's serial work per task, for ranks shaped like CUDA processes.

With ``--page-workers`` (packaging/criu-patches, patch 0002) every task's pages are written by
a thread of their own, but CRIU's main thread still visits the tasks one after another:
it reads a task's mappings, infects it, builds its pagemap and has the parasite drain its
pages into pipes before it can go on. On a real N-GPU job that serial part grows with N
(docs/benchmarks.md, "A real 4-GPU job's CRIU dump"). What makes it long is the shape of a
CUDA process more than its memory: a reservation of 16 GiB of address space that CRIU counts
as private memory, and ~2,000 mappings. ``bench/ranks_job.py --reserve-gib --maps`` gives
the stand-in's ranks that shape.

For every CRIU binary and every N: the launcher with N such ranks is dumped (exit mode) to a
directory with CRIU's log at level 4, and the log is read:

- ``criu_dump``: the whole step (spotguard's timeline);
- ``per task``: CRIU's main thread from one rank's ``Dumping task`` line to the end of its own
  work (mean over the ranks);
- ``before drain``: of it, the time from the rank's last pagemap line to the start of the
  drain (``Page pipe:``, or ``Draining pages of ...`` where the drain runs in a writer,
  patch 0006): where the iovec array was copied into the parasite's arguments (one iovec
  per private page before patch 0002 copied only those in use).

    python -m bench.criu_tasks --criu /opt/spotguard/criu/debs/criu.patched --ranks 1 4
    python -m bench.criu_tasks --criu OLD NEW --ranks 1 4 8 --mib 1024 --reserve-gib 16
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.ranks import JOB, _kill, _wait
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectoryTarget

_TS = re.compile(r"^\((\d+\.\d+)\)")


@dataclass(frozen=True)
class TaskTimes:
    """One task's span of CRIU's main thread, and of it the wait before its drain."""

    pid: int
    seconds: float
    before_drain: float
    private_pages: int


def task_times(log: str) -> list[TaskTimes]:
    """Each dumped task's main-thread span, from a CRIU dump log at level 4: from its
    ``Dumping task`` line to its ``Dumping task cwd`` line (the end of its own work; what
    follows the last task is the writers' and the post-dump hook's). Where several tasks'
    drains run at once (patch 0006) the main thread leaves a task at its drain and comes
    back to it at ``Finishing the dump of task``: its span is then the sum of both parts."""
    start: dict[int, float] = {}
    seconds: dict[int, float] = {}
    pages: dict[int, int] = {}
    pagemap: dict[int, float] = {}
    gap: dict[int, float] = {}
    cur, since = 0, 0.0  # the task the main thread works on, since when

    def leave(t: float) -> None:
        if cur:
            seconds[cur] = seconds.get(cur, 0.0) + t - since

    for line in log.splitlines():
        m = _TS.match(line)
        if not m:
            continue
        t = float(m.group(1))
        if "Dumping task (pid: " in line or "Finishing the dump of task " in line:
            leave(t)
            cur, since = int(re.findall(r"\d+", line.split(") ", 1)[1])[0]), t
            start.setdefault(cur, t)
        elif "Dumping task cwd" in line:
            leave(t)
            cur = 0
        elif "Private vmas " in line and cur:
            pages[cur] = int(line.rsplit("/", 1)[1].split()[0])
        elif "Pagemap generated" in line and cur:
            pagemap[cur] = t
        elif "page-pipe: Page pipe:" in line or "in the background" in line:
            pid = int(d[0]) if (d := re.findall(r"of (\d+) in the background", line)) else cur
            if pid in pagemap and pid not in gap:  # the drain's start, where it is logged first
                gap[pid] = t - pagemap[pid]
    return [TaskTimes(pid, seconds[pid], gap.get(pid, 0.0), pages.get(pid, 0))
            for pid in sorted(start, key=start.__getitem__) if pid in seconds]  # fmt: skip


async def one_run(criu: str, ranks: int, mib: int, reserve_gib: float, maps: int,
                  work: Path, threads: int = 0) -> dict[str, float]:  # fmt: skip
    """Dump a launcher of ``ranks`` ranks once; the figures of the table's row."""
    out = work / "out"
    argv = [sys.executable, str(JOB), "launcher", "--ranks", str(ranks), "--mib", str(mib),
            "--out", str(out), "--reserve-gib", str(reserve_gib), "--maps", str(maps),
            "--threads", str(threads)]  # fmt: skip
    job = await start_job(argv, f"criu-tasks-{ranks}", state_dir=work)
    logs = work / "logs"
    logs.mkdir()
    engine = Engine(
        Criu(criu, page_workers=max(ranks + 1, 2), log_level=4, log_dir=logs),
        settings=CheckpointSettings(state_dir=work / "state", criu_timeout=900),
    )
    try:
        await _wait(lambda: len(list(out.glob("rank-*.sum"))) == ranks, "the ranks", 1200)
        frozen = await engine.freeze(job, DirectoryTarget(work / "image"), Mode.EXIT)
    finally:
        _kill(job.pid)
    tasks = [t for t in task_times((logs / "criu-dump.log").read_text(errors="replace"))
             if t.private_pages >= reserve_gib * 262144]  # fmt: skip
    n = max(len(tasks), 1)
    return {
        "criu_dump": frozen.timeline.seconds("criu_dump") or 0.0,
        "per_task": sum(t.seconds for t in tasks) / n,
        "before_drain": sum(t.before_drain for t in tasks) / n,
        "ranks_seen": len(tasks),
    }


def _label(criu: str, all_of: list[str]) -> str:
    """A binary's name in the table: its file name, with its prefix's where two share it."""
    path = Path(criu)
    if sum(Path(c).name == path.name for c in all_of) > 1:
        return f"{path.parent.parent.name}/{path.name}"
    return path.name


def table(rows: list[tuple[str, int, dict[str, float]]]) -> str:
    """The rows as a markdown table."""
    head = "| criu | N | criu_dump s | per rank s | of it before drain s |\n" + "| --- " * 5 + "|"
    body = [f"| {c} | {n} | {r['criu_dump']:.2f} | {r['per_task']:.3f} | {r['before_drain']:.3f} |"
            for c, n, r in rows]  # fmt: skip
    return "\n".join([head, *body])


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--criu", nargs="+", required=True, help="criu binaries to compare")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    p.add_argument("--mib", type=int, default=256, help="MiB of data per rank")
    p.add_argument("--reserve-gib", type=float, default=16.0)
    p.add_argument("--maps", type=int, default=2000)
    p.add_argument("--threads", type=int, default=0, help="idle threads per rank (CUDA: ~60)")
    p.add_argument("--repeat", type=int, default=1)
    a = p.parse_args()
    rows: list[tuple[str, int, dict[str, float]]] = []
    for _ in range(a.repeat):
        for criu in a.criu:
            for n in a.ranks:
                work = Path(tempfile.mkdtemp(prefix="sg-criu-tasks-"))
                try:
                    row = await one_run(criu, n, a.mib, a.reserve_gib, a.maps, work, a.threads)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                rows.append((_label(criu, a.criu), n, row))
                print(f"{criu} N={n}: {row}", file=sys.stderr, flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
