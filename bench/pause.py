"""Leave-running pauses of one N-rank stand-in, with and without the two ways a held image
can shorten the pause: its chunks packed after the job resumes (``[checkpoint]
pack_after_resume``) and its room faulted in before the freeze (``[checkpoint]
prefault_hold``).

``bench.ranks`` runs each mode once per job; a pause is short and a small machine's timings
move by tens of percent between runs, so this bench starts the stand-in once
(``bench/ranks_job.py``) and pauses it ``--repeat`` times in each variant, interleaved, into a
file store on ``--store`` (tmpfs by default). For every pause: how long CRIU held the job
frozen (the ``criu_dump`` step, as in ``bench.ranks``), the prefault before it, when the image
was durable (the ``finish`` step's end, from the freeze's start), the chunks that waited raw;
the job's memory is checked unchanged after each. Prints one table: medians per variant.

    python -m bench.pause --ranks 2 --gib 0.5 --repeat 5         # the 2-core machine
    python -m bench.pause --ranks 8 --gib 4 --repeat 3           # the 16-core GPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench.ranks import JOB, _kill, _verify, _wait
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image import ImageSettings
from spotguard.stream import StreamTarget

#: variant → (pack_after_resume, prefault_hold)
VARIANTS = {
    "base": (False, False),
    "pack after resume": (True, False),
    "prefault": (False, True),
    "both": (True, True),
}


async def pause_once(
    engine: Engine, job: Any, store: Path, work: Path, image: ImageSettings
) -> dict[str, Any]:
    """One leave-running freeze into a fresh store directory: its figures."""
    target = StreamTarget(f"file://{store}", work_root=work, settings=image)
    try:
        result = await engine.freeze(job, target, Mode.RESUME)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    steps = result.timeline.steps
    start = steps[0].start if steps else 0.0
    done = [s for s in steps if s.name == "finish" and s.seconds is not None]
    stats = target.writer_stats.to_json() if target.writer_stats is not None else {}
    pre = [s.seconds or 0.0 for s in target.timeline_steps if s.name == "hold_prefault"]
    return {
        "pause_s": result.timeline.seconds("criu_dump"),
        "prefault_s": sum(pre),
        "durable_s": done[-1].start + (done[-1].seconds or 0.0) - start if done else None,
        "chunks": stats.get("chunks"),
        "chunks_deferred": stats.get("chunks_deferred"),
        "deferred_s": (stats.get("step_seconds") or {}).get("deferred", 0.0),
    }


async def run(a: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="sg-pause-") as tmp:
        work = Path(tmp)
        out = work / "out"
        mib = int(a.gib * 1024)
        argv = [sys.executable, str(JOB), "launcher", "--ranks", str(a.ranks), "--mib", str(mib)]
        job = await start_job([*argv, "--out", str(out)], f"pause-{a.ranks}", state_dir=work)
        named: list[str | None] = list(a.criu or [None])
        crius = {(Path(c).name if c and len(named) > 1 else ""): c for c in named}
        crits = {label: Criu(c, page_workers=a.workers or None) for label, c in crius.items()}
        image = ImageSettings()
        several = len(a.cpu_pages) > 1

        def key(name: str, label: str, who: str) -> str:
            return " · ".join(x for x in (name, label, f"cpu_pages {who}" if several else "") if x)

        engines = {
            key(name, label, who): Engine(
                crit,
                settings=CheckpointSettings(
                    state_dir=work / "state",
                    criu_timeout=900,
                    pack_after_resume=later,
                    prefault_hold=prefault,
                    cpu_pages=who,
                ),
            )
            for name, (later, prefault) in VARIANTS.items()
            if name in a.variants
            for label, crit in crits.items()
            for who in a.cpu_pages
        }
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        gen, same = 0, True
        try:
            await _wait(lambda: len(list(out.glob("rank-*.sum"))) == a.ranks, "the ranks", 1200)
            for _ in range(a.repeat):
                for name, engine in engines.items():
                    store = a.store / f"sg-pause-{uuid.uuid4().hex[:8]}"
                    row = await pause_once(engine, job, store, work, image)
                    gen += 1
                    row["identical"] = await _verify(out, a.ranks, gen)
                    same = same and row["identical"]
                    rows[name].append(row)
                    record = {"variant": name, "ranks": a.ranks, "gib": a.gib, **row}
                    print(json.dumps(record), flush=True)
                    if a.json:
                        with a.json.open("a") as f:
                            f.write(json.dumps({"bench": "pause", **record}) + "\n")
        finally:
            _kill(job.pid)
    print(table(rows, a.ranks, a.gib, next(iter(crits.values())).page_workers))
    return 0 if same else 1


def table(rows: dict[str, list[dict[str, Any]]], ranks: int, gib: float, workers: int) -> str:
    """Markdown: the median of each figure per mode."""
    lines = [
        "| variant | N | GiB/rank | page workers | runs | pause s (median) | min-max | "
        "prefault s before it | durable s (median) | chunks kept raw |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, rs in rows.items():
        if not rs:
            continue
        pauses = [r["pause_s"] for r in rs]
        durable = [r["durable_s"] for r in rs if r["durable_s"] is not None]
        kept = max(r["chunks_deferred"] or 0 for r in rs)
        total = max(r["chunks"] or 0 for r in rs)
        lines.append(
            f"| {name} | {ranks} | {gib:g} | {workers} | {len(rs)} | "
            f"{statistics.median(pauses):.2f} | {min(pauses):.2f}-{max(pauses):.2f} | "
            f"{statistics.median(r['prefault_s'] for r in rs):.2f} | "
            f"{statistics.median(durable):.2f} | {kept}/{total} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=0.25, help="GiB of memory per rank")
    p.add_argument("--ranks", type=int, default=2, help="N")
    p.add_argument("--repeat", type=int, default=3, help="pauses per mode")
    p.add_argument("--store", type=Path, default=Path("/dev/shm"), help="store parent dir")
    p.add_argument(
        "--criu",
        nargs="+",
        default=None,
        help="criu binary (default: as spotguard finds it); several: each variant with each, "
        "interleaved, named by the file's name",
    )
    p.add_argument("--workers", type=int, default=0, help="--page-workers N (0: the CPUs)")
    p.add_argument(
        "--cpu-pages",
        nargs="+",
        choices=["spotguard", "criu"],
        default=["spotguard"],
        help="who moves the ranks' memory ([checkpoint] cpu_pages); several: interleaved",
    )
    p.add_argument("--json", type=Path, help="append one JSON line per pause")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        metavar="V",
        help=f"which to run (default all: {', '.join(VARIANTS)})",
    )
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
