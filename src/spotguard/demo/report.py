"""The demo's evidence: the output comparison (the proof) and the timeline table.

Nothing here is measured by the demo itself except the moment it injected the notice: times
come from the controller's job history (one row per agent report or state change, stamped when
the controller applied it), sizes from the image's manifest, and the freeze window from the VM 1
agent's own ``image durable`` log record. A value that is not there is shown as missing, never
filled in.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

MIB = 1024 * 1024


def first_difference(expected: str, got: str) -> str | None:
    """None when ``got`` equals ``expected``; else where they first differ, quoted."""
    if got == expected:
        return None
    want = expected.splitlines()
    have = got.splitlines()
    for i, (a, b) in enumerate(zip(want, have, strict=False), start=1):
        if a != b:
            return f"line {i} differs: expected {a!r}, got {b!r}"
    if len(have) < len(want):
        return (
            f"output ends after {len(have)} lines; expected {len(want)} (next: {want[len(have)]!r})"
        )
    if len(have) > len(want):
        extra = len(have) - len(want)
        return f"output has {extra} extra line(s) after line {len(want)}: {have[len(want)]!r}"
    return "outputs differ in line endings or trailing whitespace"


@dataclass
class Row:
    """One line of the timeline: seconds since the notice, and what it says."""

    step: str
    at: float | None
    detail: str = ""


@dataclass
class DemoReport:
    """The outcome of one demo run (``--json`` prints :meth:`to_json`)."""

    ok: bool = False
    reason: str | None = None
    failed_step: str | None = None
    scenario: dict[str, Any] = field(default_factory=dict)
    proof: str | None = None
    image_url: str | None = None
    image: dict[str, Any] = field(default_factory=dict)
    timeline: list[Row] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    workdir: str | None = None
    kept: bool = False
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["timeline"] = [asdict(r) for r in self.timeline]
        return out


def _rate(nbytes: int | None, seconds: float | None) -> str:
    if not nbytes or seconds is None or seconds <= 0:
        return ""
    return f"{nbytes / MIB / seconds:.1f} MiB/s"


def _event_at(history: list[dict[str, Any]], event: str, after: float) -> float | None:
    """When the controller applied the first ``event`` report at or after ``after``."""
    for h in history:
        if (h.get("detail") or {}).get("event") == event and float(h["at"]) >= after:
            return float(h["at"])
    return None


def _moved_at(history: list[dict[str, Any]], state: str, after: float) -> float | None:
    """When the job first moved into ``state`` at or after ``after``."""
    for h in history:
        if h.get("to") == state and h.get("from") != state and float(h["at"]) >= after:
            return float(h["at"])
    return None


def _iso(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def durable_record(agent_log: Path) -> dict[str, Any]:
    """The last ``step: durable`` record of an agent's JSON-lines log (empty when none)."""
    found: dict[str, Any] = {}
    try:
        lines = agent_log.read_text(errors="replace").splitlines()
    except OSError:
        return found
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("step") == "durable" and "freeze_seconds" in rec:
            found = rec
    return found


def timeline(
    t0: float,
    history: list[dict[str, Any]],
    manifest: dict[str, Any],
    durable_log: dict[str, Any],
    *,
    notice_label: str,
    relaunched: bool,
) -> list[Row]:
    """The rows notice → frozen → durable → (relaunched → restored) → finished."""
    totals = manifest.get("totals") or {}
    meta = manifest.get("meta") or {}
    nbytes = int(totals.get("bytes") or 0) or None
    stored = int(totals.get("stored_bytes") or 0) or None

    def since(t: float | None) -> float | None:
        return None if t is None else t - t0

    rows = [Row("notice injected", 0.0, notice_label)]
    seen = _event_at(history, "notice", t0)
    raw_notice = meta.get("notice")
    notice: dict[str, Any] = raw_notice if isinstance(raw_notice, dict) else {}
    rows.append(Row("notice seen (VM 1 agent)", since(_iso(notice.get("received_at")) or seen), ""))
    frozen = _iso(meta.get("frozen_at")) or _event_at(history, "frozen", t0)
    freeze_s = durable_log.get("freeze_seconds")
    rows.append(
        Row(
            "frozen (state in host memory)",
            since(frozen),
            (f"freeze window {float(freeze_s):.2f} s" if freeze_s is not None else "")
            + (f", image {nbytes / MIB:.1f} MiB" if nbytes else ""),
        )
    )
    durable = _iso(manifest.get("created")) or _event_at(history, "durable", t0)
    up = None if durable is None or frozen is None else durable - frozen
    detail = ""
    if nbytes:
        detail = f"{nbytes / MIB:.1f} MiB → {(stored or 0) / MIB:.1f} MiB stored"
        rate = _rate(nbytes, up)
        if rate:
            detail += f", {rate} frozen → durable"
    rows.append(Row("durable (manifest in store)", since(durable), detail))
    if relaunched:
        gone = _moved_at(history, "launching", t0)
        rows.append(
            Row("job stopped on VM 1", since(gone), "its image is complete: relaunch begins")
        )
        launched = _moved_at(history, "restoring", t0)
        rows.append(Row("relaunched (VM 2 running)", since(launched), "local provider"))
        restoring = _event_at(history, "restoring", t0)
        restored = _event_at(history, "restored", t0)
        took = None if restored is None or restoring is None else restored - restoring
        rows.append(
            Row(
                "restored (job running on VM 2)",
                since(restored),
                (f"download + verify + restore {took:.2f} s" if took is not None else "")
                + (f", {_rate(nbytes, took)}" if _rate(nbytes, took) else ""),
            )
        )
    finished = _event_at(history, "job_finished", t0)
    on_vm2 = relaunched and _event_at(history, "restored", t0) is not None
    rows.append(Row(f"job finished on VM {2 if on_vm2 else 1}", since(finished), ""))
    return rows
