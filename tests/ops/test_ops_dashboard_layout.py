"""Issue 28.7: the Grafana dashboard has park panels, laid out so that Grafana shows every
panel (unique ids, inside the 24-column grid, no two panels on the same cells). Which metrics
and labels its queries name is checked against real scrapes in test_ops_metrics.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DASHBOARD = (
    Path(__file__).resolve().parents[2] / "packaging" / "grafana" / "spotguard-dashboard.json"
)


def _panels() -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = json.loads(DASHBOARD.read_text())["panels"]
    return panels


def test_panels_have_unique_ids_and_never_overlap() -> None:
    panels = _panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), ids
    taken: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"{p['title']!r} overlaps {taken[(x, y)]!r}"
                taken[(x, y)] = p["title"]


def test_the_park_row_shows_parked_jobs_their_state_and_parks_and_unparks() -> None:
    panels = _panels()
    (row,) = [p for p in panels if p["type"] == "row" and p["title"] == "Park"]
    below = [p for p in panels if p["gridPos"]["y"] > row["gridPos"]["y"]]
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in below}
    assert len(below) >= 6
    joined = " ".join(exprs.values())
    assert "spotguard_parked_jobs" in joined and "spotguard_parked_bytes" in joined
    assert 'spotguard_controller_jobs{state="parked"}' in joined
    assert 'spotguard_controller_events_total{kind="parked"}' in joined
    (moves,) = [e for t, e in exprs.items() if "unparks" in t.lower()]
    assert "clamp_min(-delta(spotguard_parked_jobs" in moves  # unparks: the gauge going down
    assert all(p.get("description") for p in below)
