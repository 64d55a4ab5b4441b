"""Plots of the recorded benchmark results, written as PNGs into docs/img/.

The figures come from the tables the benchmark scripts printed and their owners recorded in
docs/benchmarks.md (each with machine and date), so a plot always shows exactly the numbers
the text states; a JSON file written by ``python -m bench.transfer --json PATH`` can replace the
recorded transfer table, and ``spotguard demo --json`` output gives the demo's timeline plot.
A section or table that is missing is skipped with a line saying so, never invented.

Run: ``python -m bench.plots [--results docs/benchmarks.md] [--transfer-json F]
[--demo-json F] [--out docs/img]``
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

Table = list[dict[str, str]]


def tables(markdown: str, heading: str) -> list[Table]:
    """Every pipe table under the ``## heading`` section, as rows of column → cell."""
    m = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    if m is None:
        return []
    out: list[Table] = []
    current: list[list[str]] = []
    for line in [*m.group(1).splitlines(), ""]:
        if line.strip().startswith("|"):
            current.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(current) > 2:
            head = current[0]
            out.append([dict(zip(head, row, strict=False)) for row in current[2:]])
        current = []
    return out


def num(cell: str) -> float | None:
    """The first number in a cell (``**2.86x**`` gives 2.86), or None."""
    m = re.search(r"-?\d+(?:\.\d+)?", cell.replace(",", ""))
    return float(m.group()) if m else None


def _save(fig: Any, out: Path, name: str) -> Path:
    path = out / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def plot_notices(md: str, out: Path) -> Path | None:
    found = tables(md, "Notices")
    if not found:
        print("skipped notices: no table under '## Notices'")
        return None
    rows = found[0]
    labels = [r["source"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.26
    for i, col in enumerate(("median ms", "p95 ms", "max ms")):
        vals = [num(r.get(col, "")) or 0.0 for r in rows]
        ax.bar([x + (i - 1) * width for x in range(len(rows))], vals, width, label=col)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("notice → bus latency, ms")
    ax.set_title("Notice detection latency (2-core VM, emulator on loopback)")
    ax.legend(fontsize=8)
    return _save(fig, out, "notices-latency.png")


def _transfer_rows(md: str, transfer_json: Path | None) -> list[tuple[str, Table]]:
    if transfer_json is not None:
        raw = json.loads(transfer_json.read_text())
        rows = [{("MB/s" if k == "mb_s" else k): str(v) for k, v in r.items()} for r in raw]
        return [(transfer_json.stem, rows)]
    found = tables(md, "Images and stores")
    titles = ["2-core VM", "H100 VM, 16 cores"]
    return list(zip(titles, found, strict=False))


def plot_transfer(md: str, out: Path, transfer_json: Path | None) -> Path | None:
    sets = _transfer_rows(md, transfer_json)
    if not sets:
        print("skipped transfer: no table under '## Images and stores'")
        return None
    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 3.6), squeeze=False)
    for ax, (title, rows) in zip(axes[0], sets, strict=False):
        groups: dict[str, dict[str, float]] = {}
        for r in rows:
            target = r.get("target") or r.get("store") or "?"
            case = r.get("case", "")
            mbs = num(r.get("MB/s", ""))
            if mbs is None or "unchanged" in case:
                continue
            groups.setdefault(target, {})[case] = mbs
        cases = ["naive push", "spotguard push", "naive pull", "spotguard pull"]
        width = 0.8 / max(len(groups), 1)
        for i, (target, vals) in enumerate(groups.items()):
            xs = [x + i * width for x in range(len(cases))]
            ax.bar(xs, [vals.get(c, 0.0) for c in cases], width, label=target)
        ax.set_xticks(
            [x + width * (len(groups) - 1) / 2 for x in range(len(cases))], cases, fontsize=8
        )
        ax.set_ylabel("MB/s (uncompressed image)")
        ax.set_title(f"2 GiB image: naive vs chunked ({title})", fontsize=9)
        ax.legend(fontsize=7)
    return _save(fig, out, "transfer-throughput.png")


def plot_streaming(md: str, out: Path) -> Path | None:
    found = tables(md, "Streaming")
    if not found:
        print("skipped streaming: no table under '## Streaming'")
        return None
    rows = found[0]
    metrics = [
        ("freeze→durable s", "freeze → durable, s"),
        ("peak host RAM GiB", "peak host RAM, GiB"),
        ("restore s", "restore, s"),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(11, 3.4))
    sizes = sorted({r["job MiB"] for r in rows}, key=lambda s: num(s) or 0.0)
    for ax, (col, label) in zip(axes, metrics, strict=True):
        for i, pipeline in enumerate(("naive", "streamed")):
            vals = [
                next(
                    (
                        num(r[col]) or 0.0
                        for r in rows
                        if r["job MiB"] == s and r["pipeline"] == pipeline
                    ),
                    0.0,
                )
                for s in sizes
            ]
            ax.bar([x + (i - 0.5) * 0.38 for x in range(len(sizes))], vals, 0.38, label=pipeline)
        ax.set_xticks(range(len(sizes)), [f"{s} MiB job" for s in sizes], fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Staged vs streamed checkpoint (2-core VM, file store)", fontsize=10)
    return _save(fig, out, "streaming.png")


def plot_streaming_gpu(md: str, out: Path) -> Path | None:
    """The newest GPU table under Streaming (a ``job`` column in GiB, one row per pipeline)."""
    gpu = [
        t
        for t in tables(md, "Streaming")
        if t and "GiB" in t[0].get("job", "") and "pipeline" in t[0]
    ]
    if not gpu:
        print("skipped streaming (GPU): no GPU table under '## Streaming'")
        return None
    rows = gpu[-1]
    metrics = [
        ("freeze→durable s", "freeze start → durable image, s"),
        ("peak / (GPU+CPU)", "peak host RAM ÷ (GPU + CPU state)"),
        ("restore s", "restore, s"),
    ]
    jobs = sorted({r["job"] for r in rows}, key=lambda s: num(s.split()[0]) or 0.0)
    fig, axes = plt.subplots(1, len(metrics), figsize=(11, 3.4))
    for ax, (col, label) in zip(axes, metrics, strict=True):
        for i, pipeline in enumerate(("naive", "streamed")):
            vals = [
                next(
                    (num(r.get(col, "")) or 0.0 for r in rows
                     if r["job"] == j and r["pipeline"] == pipeline),
                    0.0,
                )
                for j in jobs
            ]  # fmt: skip
            ax.bar([x + (i - 0.5) * 0.38 for x in range(len(jobs))], vals, 0.38, label=pipeline)
        ax.set_xticks(range(len(jobs)), [j.replace(" (", "\n(") for j in jobs], fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Staged vs streamed checkpoint of GPU jobs (newest table)", fontsize=10)
    return _save(fig, out, "streaming-gpu.png")


def plot_ranks(md: str, out: Path) -> Path | None:
    """The newest N-rank table under Streaming (``mode``, ``N`` and ``durable s`` columns, cells
    like ``1 / 8``): N=1 and the largest N, serial against parallel, for each figure."""
    found = [t for t in tables(md, "Streaming") if t and {"mode", "N", "durable s"} <= set(t[0])]
    if not found:
        print("skipped ranks: no N-rank table under '## Streaming'")
        return None
    rows = found[-1]
    newest = rows[-1].get("call", "")
    rows = [r for r in rows if r.get("call", "") == newest]
    metrics = [("durable s", "freeze → durable, s"), ("restore s", "restore, s"),
               ("pause s", "leave-running pause, s")]  # fmt: skip
    fig, axes = plt.subplots(1, len(metrics), figsize=(11, 3.4))
    for ax, (col, label) in zip(axes, metrics, strict=True):
        for i, row in enumerate(rows):
            ns = [n.strip() for n in row["N"].split("/")]
            vals = [num(v) or 0.0 for v in row[col].replace("*", "").split("/")]
            xs = [x + (i - 0.5) * 0.38 for x in range(len(ns))]
            ax.bar(xs, vals, 0.38, label=row["mode"].split(",")[0])
            ax.set_xticks(range(len(ns)), [f"N={n}" for n in ns], fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("A job of N ranks x 4 GiB: CRIU serial vs --page-workers (newest table)",
                 fontsize=10)  # fmt: skip
    return _save(fig, out, "ranks.png")


def plot_pagecopy(md: str, out: Path) -> Path | None:
    """The newest ``bench.pagecopy`` table under Streaming (a ``threads`` column and one GB/s
    column per pass): each pass's rate against the threads making it."""
    found = [t for t in tables(md, "Streaming") if t and "threads" in t[0]
             and any("writev" in c for c in t[0])]  # fmt: skip
    if not found:
        print("skipped pagecopy: no bench.pagecopy table under '## Streaming'")
        return None
    rows = max(found, key=lambda t: len(t[0]))  # the newest table has the most passes
    threads = [num(r["threads"]) or 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for col in [c for c in rows[0] if c != "threads"]:
        ax.plot(threads, [num(r[col]) or 0.0 for r in rows], marker="o", label=col)
    ax.set_xscale("log", base=2)
    ax.set_xticks(threads, [f"{t:g}" for t in threads])
    ax.set_xlabel("threads")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=7)
    ax.set_title("GPU-memory copy through host memory, per pass (bench.pagecopy)", fontsize=10)
    return _save(fig, out, "pagecopy.png")


def _nums(cell: str) -> list[float]:
    """Every number in a cell of runs (``1.45 · 1.44 · 1.37``)."""
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", cell.replace("*", ""))]


#: where the node-scale tables are recorded (the floor and the runs after it), in the
#: document's order
FLOOR_SECTIONS = ("Streaming", "Real jobs on a GPU (`scripts/gpu-tests none`)")


def plot_floor(md: str, out: Path) -> Path | None:
    """The newest ``bench.floor`` table (the last one in :data:`FLOOR_SECTIONS`) and the
    ``bench.ranks`` runs recorded after it (``N``, ``durable s``, ``restore s``, and ``pause s``
    where both have the pause): for each, one rank and the largest N as spotguard did them
    (bar: the median; line: the runs' range), the floor of the largest N's work with the most
    threads, and the limit (1.5 x one rank's median)."""
    found = [t for section in FLOOR_SECTIONS for t in tables(md, section)]
    at = [i for i, t in enumerate(found) if t and "freeze floor s" in t[0]]
    after = (
        [t for t in found[at[-1] + 1 :] if t and {"N", "durable s", "restore s"} <= set(t[0])]
        if at
        else []
    )
    if not at or not after:
        print("skipped floor: no bench.floor table followed by a bench.ranks table")
        return None
    floor, runs = found[at[-1]], [r for r in after[0] if (num(r["N"]) or 0) >= 1]
    by_n = {int(num(r["N"]) or 0): r for r in runs if r["N"].strip().isdigit()}
    if 1 not in by_n or len(by_n) < 2:
        print("skipped floor: the bench.ranks table has no N=1 row and no larger N")
        return None
    n = max(by_n)
    best = max((r for r in floor if num(r["ranks"]) == n), key=lambda r: num(r["threads"]) or 0)
    panels = [
        ("durable s", "freeze floor s", "freeze → durable, s"),
        ("restore s", "restore floor s", "restore, s"),
        ("pause s", "pause floor s", "leave-running pause, s"),
    ]
    panels = [p for p in panels if p[0] in by_n[1] and p[1] in best]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.4))
    for ax, (col, fcol, label) in zip(axes, panels, strict=True):
        one, many = _nums(by_n[1][col]), _nums(by_n[n][col])
        names = [
            "spotguard, 1 rank",
            f"spotguard, {n} ranks",
            f"floor, {n} ranks ({best['threads']} threads)",
        ]
        mids = [statistics.median(one), statistics.median(many), num(best[fcol]) or 0.0]
        ax.bar(range(3), mids, 0.6, color=["#4c72b0", "#4c72b0", "#999999"])
        for x, vals in ((0, one), (1, many)):
            ax.vlines(x, min(vals), max(vals), color="black", linewidth=1)
        limit = 1.5 * statistics.median(one)
        ax.axhline(limit, color="#c44e52", linestyle="--", linewidth=1)
        ax.text(2.45, limit, f"limit 1.5 x 1 rank ({limit:.2f} s)", color="#c44e52", fontsize=7,
                ha="right", va="bottom")  # fmt: skip
        ax.set_xticks(range(3), names, fontsize=7)
        ax.set_title(label, fontsize=9)
    fig.suptitle(f"{n} ranks x 4 GiB: spotguard, the floor of the same work, and the limit",
                 fontsize=10)  # fmt: skip
    return _save(fig, out, "floor.png")


def plot_demo(demo_json: Path, out: Path) -> Path | None:
    report = json.loads(demo_json.read_text())
    rows = [r for r in report.get("timeline", []) if r.get("at") is not None]
    if not report.get("ok") or not rows:
        print(f"skipped demo timeline: {demo_json} holds no passing run")
        return None
    fig, ax = plt.subplots(figsize=(8, 3.2))
    names = [r["step"] for r in rows]
    ats = [float(r["at"]) for r in rows]
    ax.hlines(range(len(rows)), 0, ats, color="#bbbbbb")
    ax.plot(ats, range(len(rows)), "o", color="#1f77b4")
    for y, at in enumerate(ats):
        ax.annotate(f"{at:.2f} s", (at, y), xytext=(6, -3), textcoords="offset points", fontsize=7)
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the notice")
    sc = report.get("scenario", {})
    ax.set_title(
        f"spotguard demo: {sc.get('cloud')} {sc.get('kind')}, {sc.get('mb')} MiB job, "
        f"{sc.get('store')} store",
        fontsize=9,
    )
    return _save(fig, out, "demo-timeline.png")


def plot_prefault(md: str, out: Path) -> Path | None:
    """The ``bench.stage_prefault`` table under Streaming (``GiB``, ``mode``, ``driver
    checkpoint s``): each run's driver checkpoint, with and without the prefault, in run
    order."""
    found = [t for t in tables(md, "Streaming") if t and "mode" in t[0] and "GiB" in t[0]
             and "driver checkpoint s" in t[0]]  # fmt: skip
    if not found:
        print("skipped prefault: no bench.stage_prefault table under '## Streaming'")
        return None
    rows = found[0]  # sections are newest first
    fig, ax = plt.subplots(figsize=(7, 3.4))
    labels = [f"{r['GiB']} GiB\n" + r["mode"].split(" (")[0].replace(", ", "\n") for r in rows]
    colors = ["tab:green" if r["mode"].startswith("prefault") else "tab:gray" for r in rows]
    ax.bar(range(len(rows)), [num(r["driver checkpoint s"]) or 0.0 for r in rows], color=colors)
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("driver checkpoint, s")
    ax.set_title("The driver's checkpoint with its staging faulted in beside it (green) or "
                 "not (bench.stage_prefault)", fontsize=9)  # fmt: skip
    return _save(fig, out, "prefault.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__)
    ap.add_argument("--results", type=Path, default=Path("docs/benchmarks.md"))
    ap.add_argument("--transfer-json", type=Path, help="rows from bench.transfer --json")
    ap.add_argument("--demo-json", type=Path, help="output of spotguard demo --json")
    ap.add_argument("--out", type=Path, default=Path("docs/img"))
    args = ap.parse_args(argv)
    md = args.results.read_text()
    args.out.mkdir(parents=True, exist_ok=True)
    made = [
        plot_notices(md, args.out),
        plot_transfer(md, args.out, args.transfer_json),
        plot_streaming(md, args.out),
        plot_streaming_gpu(md, args.out),
        plot_ranks(md, args.out),
        plot_pagecopy(md, args.out),
        plot_floor(md, args.out),
        plot_prefault(md, args.out),
    ]
    if args.demo_json is not None:
        made.append(plot_demo(args.demo_json, args.out))
    print(f"{sum(p is not None for p in made)} plot(s) written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
