"""``spotguard checkpoint``'s wall time against its freeze→durable span.

What a user waits for is the command's wall time; what the checkpoint needs is freeze→durable
(the engine's first step to the manifest in the store). Everything else is the command's own
cost: interpreter start, imports, settings, job lookup, preflight, printing. This benchmark
starts one CPU job of SIZE MiB with ``spotguard run``, checkpoints it ``--runs`` times with
``--leave-running`` to a ``file://`` store and prints, per run, the wall time, freeze→durable
and the difference (and how much of it comes before the freeze); then the import time of
the command alone (``python -X importtime``).

``--src DIR`` runs the command from another checkout's ``src`` (same interpreter), so two
revisions can be compared on one machine in one sitting::

    git worktree add /tmp/base HEAD~3
    python -m bench.cli_wall --src /tmp/base/src --src src

Needs root and CRIU (as ``spotguard checkpoint`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = """
import time
b = bytearray({size} << 20)
for i in range(0, len(b), 4096):
    b[i] = i % 251
while True:
    time.sleep(0.05)
"""


def _env(src: Path, state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env["PYTHONPATH"] = str(src)
    env["SPOTGUARD_STATE_DIR"] = str(state)
    return env


def _sg(src: Path, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotguard", *args],
        env=_env(src, state),
        capture_output=True,
        text=True,
        check=False,
    )


def _one(src: Path, state: Path, store: str) -> tuple[float, float, float]:
    """(wall seconds, freeze→durable seconds, seconds before the freeze) of one
    leave-running checkpoint."""
    t0, at0 = time.perf_counter(), time.time()
    out = _sg(src, state, "checkpoint", "bench", "--leave-running", "--to", store, "--json")
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"checkpoint failed: {out.stderr.strip()[-400:]}")
    res = json.loads(out.stdout)
    start = float(res["frozen_at"]) - float(res["freeze_seconds"])  # Unix times
    return wall, float(res["durable_at"]) - start, start - at0


def _import_seconds(src: Path, state: Path) -> float:
    """Seconds ``python -X importtime`` counts for everything ``checkpoint --help`` imports."""
    env = _env(src, state)
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "spotguard", "checkpoint", "--help"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    total = 0
    for line in out.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            field = line.split(":", 1)[1].split("|")[0].strip()
            if field.isdigit():
                total += int(field)
    return total / 1e6


def bench(src: Path, size: int, runs: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="sg-cli-wall-") as tmp:
        state, store = Path(tmp) / "state", f"file://{tmp}/store"
        started = _sg(
            src, state, "run", "--name", "bench", "--no-protect", "--", sys.executable, "-c",
            JOB.format(size=size),
        )  # fmt: skip
        if started.returncode != 0:
            raise SystemExit(f"run failed: {started.stderr.strip()[-400:]}")
        try:
            time.sleep(1.0 + size / 1000)
            _one(src, state, store)  # warm the page cache and the store's chunks
            walls, spans, befores = zip(
                *(_one(src, state, store) for _ in range(runs)), strict=True
            )
        finally:
            subprocess.run(["pkill", "-9", "-f", f"{tmp}/state"], check=False)
            _sg(src, state, "checkpoint", "bench", "--to", store)  # stops the job (exit mode)
        imports = _import_seconds(src, state)
    return {
        "src": str(src),
        "wall": statistics.median(walls),
        "span": statistics.median(spans),
        "outside": statistics.median(w - s for w, s in zip(walls, spans, strict=True)),
        "before": statistics.median(befores),
        "imports": imports,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", action="append", type=Path, help="a checkout's src (repeatable)")
    ap.add_argument("--size", type=int, default=800, help="job memory, MiB")
    ap.add_argument("--runs", type=int, default=7)
    a = ap.parse_args()
    srcs = a.src or [Path(__file__).resolve().parent.parent / "src"]
    rows = [bench(s.resolve(), a.size, a.runs) for s in srcs]
    print(f"spotguard checkpoint --leave-running, {a.size} MiB job, median of {a.runs} runs")
    print("| src | wall s | freeze→durable s | outside s | of it before the freeze s | imports s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['src']} | {r['wall']:.2f} | {r['span']:.2f} | {r['outside']:.2f} "
            f"| {r['before']:.2f} | {r['imports']:.2f} |"
        )


if __name__ == "__main__":
    main()
