"""Timed steps: every operation's timeline, recorded in results, manifests and reports.

A :class:`Timeline` is a list of named steps with wall-clock start and duration. Steps may
overlap (streamed dump and upload do); :meth:`Timeline.step` is a context manager so a step is
timed whether it succeeds or fails, and a failed step is marked so in the record.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any


@dataclass
class Step:
    """One timed step. ``start`` is a Unix timestamp; ``seconds`` is None while running."""

    name: str
    start: float
    seconds: float | None = None
    ok: bool = True
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> float | None:
        return None if self.seconds is None else self.start + self.seconds


@dataclass
class Timeline:
    """Ordered, possibly overlapping, timed steps of one operation."""

    steps: list[Step] = field(default_factory=list)

    @contextmanager
    def step(self, name: str, **detail: Any) -> Iterator[Step]:
        """Time the body as step ``name``; a raised exception marks it failed and propagates."""
        wall = time.time()
        t0 = time.perf_counter()
        s = Step(name=name, start=wall, detail=dict(detail))
        self.steps.append(s)
        try:
            yield s
        except BaseException:
            s.ok = False
            raise
        finally:
            s.seconds = time.perf_counter() - t0

    def mark(self, name: str, **detail: Any) -> Step:
        """Record an instant (zero-length step), e.g. "notice received"."""
        s = Step(name=name, start=time.time(), seconds=0.0, detail=dict(detail))
        self.steps.append(s)
        return s

    def seconds(self, name: str) -> float | None:
        """Duration of the last step called ``name``, if it finished."""
        for s in reversed(self.steps):
            if s.name == name:
                return s.seconds
        return None

    def failed_step(self) -> str | None:
        """The name of the last step that did not finish well (for a failure's log line)."""
        for st in reversed(self.steps):
            if not st.ok:
                return st.name
        return None

    def span(self) -> float:
        """Seconds from the first step's start to the last step's end."""
        ends = [s.end for s in self.steps if s.end is not None]
        if not self.steps or not ends:
            return 0.0
        return max(ends) - min(s.start for s in self.steps)

    def to_list(self) -> list[dict[str, Any]]:
        """JSON-ready form: one dict per step with ISO start time."""
        out = []
        for s in self.steps:
            d = asdict(s)
            d["start_iso"] = datetime.fromtimestamp(s.start, UTC).isoformat()
            out.append(d)
        return out

    @classmethod
    def from_list(cls, items: list[dict[str, Any]]) -> Timeline:
        return cls(
            [
                Step(
                    name=i["name"],
                    start=i["start"],
                    seconds=i.get("seconds"),
                    ok=i.get("ok", True),
                    detail=i.get("detail", {}),
                )
                for i in items
            ]
        )
