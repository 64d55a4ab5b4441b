"""Recovery strategies: in which order to try offers when a job must move.

A strategy is chosen by name from :data:`STRATEGIES`. Each overrides one method,
:meth:`Strategy.order`, which sorts offers (all of which can restore the image) into the order
to try them; :meth:`Strategy.candidates` adds what is common: spot before on-demand (on-demand
only as a fallback, when allowed), at most ``types_per_zone`` instance types per zone, at most
``limit`` attempts.

Errors decide what happens next (the controller, not the strategy, applies this):
:class:`~spotguard.errors.CapacityError` → the next candidate;
:class:`~spotguard.errors.PrecheckError` or :class:`~spotguard.errors.UnknownInstanceType` →
give up (job FAILED); no candidates at all →
:class:`~spotguard.errors.NoMatchingOffer` (job FAILED).
"""

from __future__ import annotations

from typing import ClassVar

from spotguard.errors import ConfigError
from spotguard.providers.base import LaunchSpec, Market, Offer


class Strategy:
    """Base: keeps the provider's order (regions as configured, preferred type first)."""

    name: ClassVar[str] = ""

    def order(self, spec: LaunchSpec, offers: list[Offer]) -> list[Offer]:
        """The offers in the order to try them. Must return a permutation of ``offers``."""
        return list(offers)

    def candidates(
        self,
        spec: LaunchSpec,
        offers: list[Offer],
        *,
        on_demand_fallback: bool = True,
        types_per_zone: int = 1,
        limit: int = 24,
    ) -> list[Offer]:
        spot = [o for o in offers if o.market is Market.SPOT]
        on_demand = [o for o in offers if o.market is Market.ON_DEMAND]
        ordered = self.order(spec, spot)
        if on_demand_fallback or not spot:
            ordered += self.order(spec, on_demand)
        seen: dict[tuple[str, str, Market], int] = {}
        out: list[Offer] = []
        for o in ordered:
            key = (o.region, o.zone, o.market)
            if seen.get(key, 0) >= types_per_zone:
                continue
            seen[key] = seen.get(key, 0) + 1
            out.append(o)
        return out[:limit]


STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make a strategy selectable by its ``name``."""
    STRATEGIES[cls.name] = cls
    return cls


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; :class:`~spotguard.errors.ConfigError` if none."""
    try:
        return STRATEGIES[name]()
    except KeyError:
        known = ", ".join(sorted(STRATEGIES))
        raise ConfigError(f"unknown recovery strategy {name!r} (known: {known})") from None


def _region_rank(spec: LaunchSpec, offers: list[Offer]) -> dict[str, int]:
    regions: list[str] = []
    for o in offers:
        if o.region not in regions:
            regions.append(o.region)
    return {r: (0 if r == spec.region else 1 + i) for i, r in enumerate(regions)}


@register
class SameZoneFirst(Strategy):
    """Retry where the job was, then widen: same zone → other zones → other regions.

    Capacity often returns to the zone that preempted the job within minutes, and staying
    keeps data close. Example (job ran in us-east-1a, regions us-east-1, us-west-2)::

        us-east-1a spot    InsufficientInstanceCapacity   → next
        us-east-1b spot    InsufficientInstanceCapacity   → next
        us-east-1c spot    launched                       → RESTORING
        (then us-west-2a, us-west-2b ... spot; then the same order on-demand)
    """

    name = "same-zone-first"

    def order(self, spec: LaunchSpec, offers: list[Offer]) -> list[Offer]:
        rank = _region_rank(spec, offers)
        return sorted(offers, key=lambda o: (rank[o.region], o.zone != spec.zone))


@register
class EagerNextRegion(Strategy):
    """Leave the region that preempted the job first; come back to it last.

    A preemption often means the whole region is short of that GPU. Example (job ran in
    us-east-1a, regions us-east-1, us-west-2)::

        us-west-2a spot    InsufficientInstanceCapacity   → next
        us-west-2b spot    launched                       → RESTORING
        (then us-east-1b, us-east-1c ..., us-east-1a last; then the same order on-demand)
    """

    name = "eager-next-region"

    def order(self, spec: LaunchSpec, offers: list[Offer]) -> list[Offer]:
        rank = _region_rank(spec, offers)
        return sorted(
            offers,
            key=lambda o: (o.region == spec.region, rank[o.region], o.zone == spec.zone),
        )
