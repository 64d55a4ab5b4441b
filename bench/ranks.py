"""N-rank stand-in: a launcher with N exec'd ranks, each holding GiB of CPU memory, frozen to a
file store (streamed), restored, and paused in leave-running mode; with CRIU's
``--page-workers`` (packaging/criu-patches) and without it.

What CRIU sees on an N-GPU node once the driver has moved each rank's GPU memory into host
memory (bench/ranks_job.py: half random, half zero pages, distinct per rank). For every N:

1. leave-running freeze (``Mode.RESUME``): the pause is how long CRIU held the job frozen
   (the ``criu_dump`` step); the job's memory is then checked unchanged;
2. exit freeze (``Mode.EXIT``): seconds from the freeze call until the image is durable;
3. restore from the store (``StreamSource``): seconds until the job runs; every rank's memory
   checked byte-identical (SHA-1 before the freeze == after the restore).

The table gives each figure, its ratio to N=1 of the same mode and PASS/FAIL against issue 25's
target (N <= 1.5 x N=1, for every N > 1 of the parallel mode). The store goes under ``--store``
(default /dev/shm: tmpfs, as measured in the issue), a fresh directory per run.

    python -m bench.ranks --gib 0.25 --ranks 1 2                  # a 2-core machine
    python -m bench.ranks --gib 4 --ranks 1 4 8 --json out.jsonl  # the 16-core GPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from bench.readers import Readers
from bench.stacks import Stacks
from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import Criu, has_page_workers
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image import ImageSettings
from spotguard.stream import StreamSource, StreamTarget

JOB = Path(__file__).resolve().parent / "ranks_job.py"
TARGET_RATIO = 1.5
FIGURES = ("durable_s", "restore_s", "pause_s")


async def _wait(cond: Any, what: str, limit: float) -> None:
    end = time.monotonic() + limit
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _verify(out: Path, ranks: int, gen: int) -> bool:
    (out / f"verify-{gen}").touch()
    await _wait(
        lambda: all((out / f"rank-{i}.sum-{gen}").exists() for i in range(ranks)),
        f"verify-{gen}",
        600,
    )
    return all(
        (out / f"rank-{i}.sum").read_text() == (out / f"rank-{i}.sum-{gen}").read_text()
        for i in range(ranks)
    )


def _kill(pid: int) -> None:
    with contextlib.suppress(Exception):
        if proctree.alive(pid):
            proctree.signal_all([pid], signal.SIGKILL)


async def one_run(
    ranks: int,
    gib: float,
    workers: int,
    store_root: Path,
    work: Path,
    criu: str | None,
    profile: bool = False,
) -> dict[str, Any]:
    """One job of ``ranks`` ranks: pause (leave-running), durable (exit), restore."""
    mib = int(gib * 1024)
    out = work / "out"
    argv = [sys.executable, str(JOB), "launcher", "--ranks", str(ranks), "--mib", str(mib)]
    job: JobInfo = await start_job([*argv, "--out", str(out)], f"ranks-{ranks}", state_dir=work)
    pids = [job.pid]
    settings = CheckpointSettings(state_dir=work / "state", criu_timeout=900)
    logs = work / "criu-logs"
    logs.mkdir(exist_ok=True)
    crit = Criu(criu, page_workers=workers, log_level=4 if profile else 2, log_dir=logs)
    engine = Engine(crit, settings=settings)
    image = ImageSettings()
    row: dict[str, Any] = {"ranks": ranks, "gib": gib, "page_workers": workers}
    stores = [store_root / f"sg-ranks-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    try:
        await _wait(lambda: len(list(out.glob("rank-*.sum"))) == ranks, "the ranks", 1200)
        paused = StreamTarget(f"file://{stores[0]}", work_root=work, settings=image)
        with Readers() if profile else contextlib.nullcontext() as prd:
            resumed = await engine.freeze(job, paused, Mode.RESUME)
        row["pause_s"] = resumed.timeline.seconds("criu_dump")
        # where the pause goes: each step from the freeze's start (s), the capture's readers
        t_start = resumed.timeline.steps[0].start if resumed.timeline.steps else 0.0
        row["pause_steps"] = [
            (x.name, round(x.start - t_start, 3), x.seconds and round(x.seconds, 3))
            for x in resumed.timeline.steps
        ]
        if paused.capture_stats is not None:
            row["pause_capture"] = paused.capture_stats.to_json()
        if prd is not None:
            row["pause_readers"] = prd.summary()
            print(_events(logs / "criu-dump.log", _DUMP_EVENTS), file=sys.stderr, flush=True)
        row["identical_after_pause"] = await _verify(out, ranks, 1)
        shutil.rmtree(stores[0], ignore_errors=True)

        target = StreamTarget(f"file://{stores[1]}", work_root=work, settings=image)
        t0, cpu0, wall0 = time.monotonic(), _cpu(), time.time()
        with (
            Stacks(None, 0.02) if profile else contextlib.nullcontext() as fst,
            Readers() if profile else contextlib.nullcontext() as rd,
        ):
            frozen = await engine.freeze(job, target, Mode.EXIT)
        row["returned_s"] = time.monotonic() - t0
        # Durable = the manifest written, in CRIU's post-dump step (as bench.stream counts
        # it); the engine returns later, once CRIU has killed the ranks and ended (0.3-0.7 s,
        # the freed memory): returned_s.
        done = [x for x in frozen.timeline.steps if x.name == "finish" and x.seconds]
        committed = done[-1].start + (done[-1].seconds or 0) - wall0 if done else None
        row["committed_s"] = None if committed is None else round(committed, 3)
        row["durable_s"] = row["returned_s"] if committed is None else committed
        if rd is not None:
            row["readers"] = rd.summary()
            print(f"capture readers, {ranks} ranks: {row['readers']}", file=sys.stderr, flush=True)
            print(_events(logs / "criu-dump.log", _DUMP_EVENTS), file=sys.stderr, flush=True)
        if fst is not None:
            print(fst.roles(f"freeze of {ranks} ranks"), file=sys.stderr, flush=True)
            print(fst.table(f"freeze of {ranks} ranks", top=30), file=sys.stderr, flush=True)
        row["profile"] = _profile(frozen.timeline.to_list(), cpu0, target, row["durable_s"])
        print(f"ranks {ranks} x {gib} GiB, page workers {workers}: {row['profile']}",
              file=sys.stderr, flush=True)  # fmt: skip
        assert target.url is not None
        if target.capture_stats is not None:
            row["bytes"] = target.capture_stats.bytes
        t0, cpu0 = time.monotonic(), _cpu()
        source = StreamSource(target.url, settings=image, work_root=work)
        with Stacks(None, 0.02) if profile else contextlib.nullcontext() as st:
            restored = await engine.restore(source, state_dir=work / "state")
        if st is not None:
            print(st.roles(f"restore of {ranks} ranks"), file=sys.stderr, flush=True)
            print(st.table(f"restore of {ranks} ranks", top=24), file=sys.stderr, flush=True)
            print(_restore_events(logs / "criu-restore.log"), file=sys.stderr, flush=True)
            if os.environ.get("SPOTGUARD_BENCH_KEEP_LOG"):
                shutil.copy(logs / "criu-restore.log", os.environ["SPOTGUARD_BENCH_KEEP_LOG"])
        row["restore_s"] = time.monotonic() - t0
        row["restore_profile"] = _restore_profile(restored.timeline.to_list(), cpu0, source, row)
        print(f"restore ranks {ranks}: {row['restore_profile']}", file=sys.stderr, flush=True)
        pids.append(restored.pid)
        row["identical_after_restore"] = await _verify(out, ranks, 2)
    finally:
        for pid in pids:
            _kill(pid)
        for s in stores:
            shutil.rmtree(s, ignore_errors=True)
    return row


def _cpu() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its waited-for children (CRIU)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def _profile(
    timeline: list[dict[str, Any]], cpu0: tuple[float, float], target: Any, wall: float
) -> dict[str, Any]:
    """Where an exit freeze's time went: its steps, the CPU seconds spotguard's process and
    CRIU (children) used over it (cores busy = CPU / wall), and the chunk pipeline's summed
    waits per stage."""
    me, kids = _cpu()
    out: dict[str, Any] = {
        "steps": {t["name"]: round(t["seconds"] or 0.0, 3) for t in timeline if t.get("seconds")},
        "cpu_spotguard_s": round(me - cpu0[0], 2),
        "cpu_criu_s": round(kids - cpu0[1], 2),
        "cores_busy": round((me - cpu0[0] + kids - cpu0[1]) / max(wall, 1e-9), 1),
    }
    if target.writer_stats is not None:
        w = target.writer_stats.to_json()
        out["writer_stage_s"] = w.get("step_seconds")
        out["chunks_raw"] = w.get("chunks_raw")
        out["chunks"] = w.get("chunks")
    return out


#: what CRIU's restore log (-v4) says about each task's start and memory, in order
_EVENTS = ("Forking task", "Prefaulting", "Prefaulted", "Opened stream page read",
           "Restore on-core sigactions", "restore_finish_stage", "Restoring children",
           "Running pre-resume")  # fmt: skip


#: what CRIU's dump log (-v4) says about when each task's pages were drained and written
_DUMP_EVENTS = ("Dumping task (pid", "Dumping pages (type", "in the background",
                "Wrote pages of", "written in chunks", "Unfreezing", "Writing stats")  # fmt: skip


def _restore_events(log: Path) -> str:
    """Timestamped lines of CRIU's restore log that show when each task started, read its
    memory and reached the next stage: whether the tasks read at once or one after another."""
    return _events(log, _EVENTS)


def _events(log: Path, events: tuple[str, ...]) -> str:
    """The timestamped lines of a CRIU log that hold one of ``events``."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log {log.name}: {exc})"
    keep = [ln for ln in lines if any(e in ln for e in events)]
    return f"CRIU events ({log.name}):\n" + "\n".join(keep[:120])


def _restore_profile(
    timeline: list[dict[str, Any]], cpu0: tuple[float, float], source: Any, row: dict[str, Any]
) -> dict[str, Any]:
    """Where a restore's time went: its steps, CPU of spotguard and CRIU, the image reader's
    summed stage seconds (``read_raw``: raw chunks read into place and hashed)."""
    me, kids = _cpu()
    out: dict[str, Any] = {
        "steps": {t["name"]: round(t["seconds"] or 0.0, 3) for t in timeline if t.get("seconds")},
        "cpu_spotguard_s": round(me - cpu0[0], 2),
        "cpu_criu_s": round(kids - cpu0[1], 2),
        "cores_busy": round((me - cpu0[0] + kids - cpu0[1]) / max(row["restore_s"], 1e-9), 1),
    }
    if source.serve_stats is not None:
        out["serve"] = source.serve_stats.to_json()
    stats = getattr(source, "reader_stats", None)  # (older trees lack it)
    if stats is not None:
        out["reader_stage_s"] = {k: round(v, 2) for k, v in stats.step_seconds.items()}
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: figures, ratio to N=1 of the same mode, PASS/FAIL for parallel N>1."""
    base = {(r["page_workers"] > 1, f): r.get(f) for r in rows if r["ranks"] == 1 for f in FIGURES}
    lines = [
        "| mode | N | GiB/rank | durable s | restore s | pause s | ratio to N=1 (d/r/p) | "
        "identical | target N <= 1.5 x N=1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        par = r["page_workers"] > 1
        ratios = []
        for f in FIGURES:
            b = base.get((par, f))
            ratios.append(r[f] / b if b and r.get(f) is not None else None)
        ok = r.get("identical_after_pause") and r.get("identical_after_restore")
        if r["ranks"] == 1 or not par:
            verdict = "—"
        else:
            verdict = "PASS" if all(x is not None and x <= TARGET_RATIO for x in ratios) else "FAIL"
        mode = f"parallel ({r['page_workers']})" if par else "serial"
        lines.append(
            f"| {mode} | {r['ranks']} | {r['gib']:g} | {r['durable_s']:.2f} | "
            f"{r['restore_s']:.2f} | {r['pause_s']:.2f} | "
            + "/".join("-" if x is None else f"{x:.2f}" for x in ratios)
            + f" | {'yes' if ok else 'NO'} | {verdict} |"
        )
    return "\n".join(lines)


GIB = 1 << 30


def _memory_needed(n: int, gib: float) -> int:
    """Bytes a run of ``n`` ranks holds at its peak: the ranks' memory, their image in the
    tmpfs store (the random half stored raw, a little for the rest) and a margin."""
    return int(n * gib * GIB * 1.6) + (1 << 30)


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=0.25, help="GiB of memory per rank")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="values of N")
    p.add_argument("--store", type=Path, default=Path("/dev/shm"), help="store parent dir")
    p.add_argument("--criu", default=None, help="criu binary (default: as spotguard finds it)")
    p.add_argument(
        "--workers", type=int, default=0, help="--page-workers N (default: the machine's CPUs)"
    )
    p.add_argument(
        "--modes", nargs="+", choices=["serial", "parallel"], default=["serial", "parallel"]
    )
    p.add_argument("--json", type=Path, help="append one JSON line per run")
    p.add_argument(
        "--profile", action="store_true", help="thread states and kernel stacks over each restore"
    )
    a = p.parse_args()
    probe = Criu(a.criu, page_workers=a.workers or None)
    workers = max(probe.page_workers, 2)
    if "parallel" in a.modes and not has_page_workers(probe.path):
        print(f"{probe.path} has no --page-workers: scripts/install-criu builds it", flush=True)
        a.modes = [m for m in a.modes if m != "parallel"]
    print(f"criu {probe.path} ({await probe.version()}), page workers {workers}", flush=True)
    rows: list[dict[str, Any]] = []
    failed = False
    for mode in a.modes:
        for n in sorted(a.ranks):
            need, have = _memory_needed(n, a.gib), psutil.virtual_memory().available
            if need > have:
                why = f"needs ~{need / GIB:.1f} GiB of memory, {have / GIB:.1f} GiB available"
                print(f"{mode} N={n}: skipped: {why}", flush=True)
                continue
            with tempfile.TemporaryDirectory(prefix="sg-ranks-") as tmp:
                w = workers if mode == "parallel" else 0
                try:
                    row = await one_run(n, a.gib, w, a.store, Path(tmp), probe.path, a.profile)
                except Exception as exc:  # noqa: BLE001 - reported per row, the others go on
                    print(f"{mode} N={n}: failed: {exc}", flush=True)
                    failed = True
                    continue
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.json:
                with a.json.open("a") as f:
                    f.write(json.dumps({"bench": "ranks", **row}) + "\n")
    print(table(rows), flush=True)
    bad = any(not (r["identical_after_pause"] and r["identical_after_restore"]) for r in rows)
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
