"""Print each speed target with its measured value and PASS / FAIL.

Reads the JSON lines ``bench.stream --json`` and ``bench.park --json`` wrote (``scripts/gpu-
bench`` keeps them in its output folder) and checks them against the targets of the
checkpoint speed work (H200, THP always) and of the node-scale work (issue 25):

* 40 GiB job: freeze → durable ≤ 20 s (it was 30 s before the node-scale work); restore
  ≤ 12 s
* 10 GiB job: streamed ≥ 3x the naive pipeline; restore ≤ 1.2x its slowest stage
* peak host RAM during a streamed freeze ≤ 1.3x (GPU + CPU state)
* 8 GiB model server: park ≤ 5 s; unpark (from memory) to its first answer ≤ 3 s
* a job on N GPUs (one process per GPU, SIZE GiB each): freeze → durable ≤ 1.3x the same
  job on one GPU (``bench.stream --gpus N``, the multi-GPU work)
* the N-rank stand-in (``bench.ranks``, parallel mode): N ranks' freeze → durable, restore
  and leave-running pause ≤ 1.5x one rank's; beside the freeze and the restore, the floor of
  the same work on this machine (``bench.floor``, most threads) where it was measured — a
  limit below the floor cannot be met here however the work is ordered

A target with no measurement is listed as ``not run``. Exit status 1 when any measured target
fails. Run: ``python -m bench.targets OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = dict[str, Any]
TARGET_RATIO = 1.5  # issue 25: N ranks at most 1.5x one rank


def _rows(path: Path) -> list[Row]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
        elif line.startswith("["):
            out.extend(json.loads(line))
    return out


def _pick(rows: list[Row], size: float, pipeline: str, gpus: int = 1) -> Row | None:
    return next(
        (
            r
            for r in reversed(rows)
            if r.get("size") == size and r.get("pipeline") == pipeline and r.get("gpus", 1) == gpus
        ),
        None,
    )


def _multi_gpu(stream: list[Row]) -> list[tuple[str, str, str, bool | None]]:
    """N x SIZE GiB against 1 x SIZE GiB, streamed freeze → durable, for each N measured."""
    out = []
    for n, size in sorted({(r["gpus"], r["size"]) for r in stream if r.get("gpus", 1) > 1}):
        multi, one = _pick(stream, size, "streamed", n), _pick(stream, size, "streamed")
        ratio = multi["total"] / one["total"] if multi and one else None
        name = f"{n} x {size:g} GiB vs 1 x {size:g} GiB freeze → durable"
        out.append(_check(name, ratio, 1.3, lambda got, lim: got <= lim, "x"))
        back = multi["restore"] / one["restore"] if multi and one else None
        name = f"{n} x {size:g} GiB vs 1 x {size:g} GiB restore (issue 25: N ranks)"
        out.append(_check(name, back, 1.5, lambda got, lim: got <= lim, "x"))
    return out


def _node_scale(ranks: list[Row], floor: list[Row]) -> list[tuple[str, str, str, bool | None]]:
    """N ranks against one rank of the same size (``bench.ranks``' parallel rows, the last
    of each N), with the floor of N ranks' work where ``bench.floor`` measured it."""
    par = [r for r in ranks if r.get("page_workers", 0) > 1]
    out = []
    for n, gib in sorted({(r["ranks"], r["gib"]) for r in par if r["ranks"] > 1}):
        row = next(r for r in reversed(par) if (r["ranks"], r["gib"]) == (n, gib))
        one = next((r for r in reversed(par) if (r["ranks"], r["gib"]) == (1, gib)), None)
        fl = [f for f in floor if (f.get("ranks"), f.get("gib")) == (n, gib)]
        best = max(fl, key=lambda f: int(f["threads"])) if fl else None
        for fig, label, floor_key in (
            ("durable_s", "freeze → durable", "freeze_s"),
            ("restore_s", "restore", "restore_s"),
            ("pause_s", "leave-running pause", "pause_s"),
        ):
            got, base = row.get(fig), one and one.get(fig)
            ratio = got / base if got and base else None
            name = f"{n} ranks vs 1 rank x {gib:g} GiB, {label} (issue 25)"
            checked = _check(name, ratio, TARGET_RATIO, lambda g, lim: g <= lim, "x")
            if ratio is not None and best is not None and floor_key is not None and base:
                if floor_key not in best:  # a floor measured before the pause had one
                    out.append(checked)
                    continue
                limit_s, floor_s = TARGET_RATIO * base, float(best[floor_key])
                note = f" ({got:.2f} s; the floor {floor_s:.2f} s, the limit {limit_s:.2f} s)"
                checked = (checked[0], checked[1] + note, checked[2], checked[3])
            out.append(checked)
    return out


def _check(
    name: str, got: float | None, limit: float, ok: Callable[[float, float], bool], unit: str
) -> tuple[str, str, str, bool | None]:
    if got is None:
        return name, "not run", f"{limit:g}{unit}", None
    passed = ok(got, limit)
    return name, f"{got:.2f}{unit}", f"{limit:g}{unit}", passed


def targets(out_dir: Path) -> list[tuple[str, str, str, bool | None]]:
    stream = _rows(out_dir / "stream.jsonl")
    park = _rows(out_dir / "park.jsonl")
    le: Callable[[float, float], bool] = lambda got, lim: got <= lim  # noqa: E731
    ge: Callable[[float, float], bool] = lambda got, lim: got >= lim  # noqa: E731
    s40, s10, n10 = (
        _pick(stream, 40.0, "streamed"),
        _pick(stream, 10.0, "streamed"),
        _pick(stream, 10.0, "naive"),
    )
    res = [
        _check("40 GiB freeze → durable", s40 and s40["total"], 20, le, " s"),
        _check("40 GiB restore", s40 and s40["restore"], 12, le, " s"),
        _check(
            "10 GiB streamed vs naive freeze → durable",
            (n10["total"] / s10["total"]) if s10 and n10 else None,
            3,
            ge,
            "x",
        ),
    ]
    if s10 and n10:
        # everything before the driver's restore: the source, CRIU, and the GPU memory
        # written back beside CRIU (gpupages), all pipelined with the read of the image
        piped = s10["restore"] - s10["restore_stages"].get("gpu_restore", 0.0)
        if ov := s10.get("restore_overlap"):  # placed under the driver: until the last page
            piped += float(ov.get("pages_s") or 0.0)
        slowest = max(s10["read_alone"], n10["restore_stages"]["criu_restore"])
        res.append(_check("10 GiB restore / slowest stage", piped / slowest, 1.2, le, "x"))
    else:
        res.append(_check("10 GiB restore / slowest stage", None, 1.2, le, "x"))
    peaks = [
        r["peak_ram"] / (r["estimate"]["gpu_bytes"] + r["estimate"]["cpu_bytes"])
        for r in stream
        if r.get("pipeline") == "streamed"
    ]
    res.append(_check("streamed peak RAM / (GPU+CPU)", max(peaks) if peaks else None, 1.3, le, "x"))
    p8 = next((r for r in reversed(park) if r.get("size_gib") == 8.0), None)
    res.append(_check("8 GiB server park", p8 and p8["park_s"], 5, le, " s"))
    res.append(_check("8 GiB server unpark → first answer", p8 and p8["unpark_to_answer_s"], 3,
                      le, " s"))  # fmt: skip
    ranks, floor = _rows(out_dir / "ranks.jsonl"), _rows(out_dir / "floor.jsonl")
    return res + _multi_gpu(stream) + _node_scale(ranks, floor)


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    rows = targets(out_dir)
    print("| target | measured | limit | result |")
    print("| --- | --- | --- | --- |")
    failed = False
    for name, got, limit, passed in rows:
        verdict = "not run" if passed is None else ("PASS" if passed else "FAIL")
        failed = failed or passed is False
        print(f"| {name} | {got} | {limit} | {verdict} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
