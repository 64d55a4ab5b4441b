"""Exponential backoff with jitter, capped: how long the bus waits before restarting a source.

``delay(n)`` for the n-th consecutive failure (n ≥ 1) lies in ``[d/2, d]`` with
``d = min(cap, initial * 2 ** (n - 1))`` — the "equal jitter" scheme: it grows fast, never
exceeds the cap, and sources failing together do not retry in lockstep.

Why not :mod:`spotguard.retry`: that one retries a single call until it succeeds or gives up.
Here there is no call to retry: a notice source is a long-running poller that the supervisor
restarts whenever it ends, for as long as the agent runs; the failure count lives across those
runs and :meth:`Backoff.reset` clears it once a source has run healthily, which a per-call
retry loop cannot express. The jitter scheme differs too (half the delay fixed, half random).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Delays for consecutive failures; :meth:`reset` after a success."""

    initial: float = 0.5
    cap: float = 10.0
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.cap:
            raise ValueError(f"backoff needs 0 < initial <= cap, got {self.initial}, {self.cap}")

    def ceiling(self, n: int) -> float:
        """The largest delay after the n-th consecutive failure."""
        return min(self.cap, self.initial * 2.0 ** min(max(n, 1) - 1, 62))

    def next(self) -> float:
        """Record one more failure and return how long to wait."""
        self.failures += 1
        top = self.ceiling(self.failures)
        return top / 2 + float(self.rng.uniform(0, top / 2))

    def reset(self) -> None:
        self.failures = 0
