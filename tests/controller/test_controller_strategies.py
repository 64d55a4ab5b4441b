"""Recovery strategies: the documented example sequences, and the registry."""

from __future__ import annotations

import pytest

from spotguard.controller.strategies import STRATEGIES, get_strategy
from spotguard.errors import ConfigError
from spotguard.providers.base import LaunchSpec, Market, Offer


def offers() -> list[Offer]:
    out = []
    for region, zones in (("us-east-1", "abc"), ("us-west-2", "ab")):
        for z in zones:
            for t in ("g5.xlarge", "g5.2xlarge"):
                for m in (Market.SPOT, Market.ON_DEMAND):
                    out.append(Offer("aws", region, f"{region}{z}", t, "a10g", 1, m))
    return out


SPEC = LaunchSpec(gpu_model="a10g", gpu_count=1, region="us-east-1", zone="us-east-1b")


def labels(cands: list[Offer]) -> list[str]:
    return [f"{o.zone}/{o.market.value}" for o in cands]


def test_same_zone_first_retries_the_zone_then_widens() -> None:
    cands = get_strategy("same-zone-first").candidates(SPEC, offers())
    assert labels(cands) == [
        "us-east-1b/spot", "us-east-1a/spot", "us-east-1c/spot", "us-west-2a/spot",
        "us-west-2b/spot", "us-east-1b/on-demand", "us-east-1a/on-demand",
        "us-east-1c/on-demand", "us-west-2a/on-demand", "us-west-2b/on-demand",
    ]  # fmt: skip
    assert {o.instance_type for o in cands} == {"g5.xlarge"}  # one type per zone by default


def test_eager_next_region_leaves_first_and_comes_back_last() -> None:
    cands = get_strategy("eager-next-region").candidates(
        SPEC, offers(), on_demand_fallback=False, types_per_zone=2
    )
    assert labels(cands) == [
        "us-west-2a/spot", "us-west-2a/spot", "us-west-2b/spot", "us-west-2b/spot",
        "us-east-1a/spot", "us-east-1a/spot", "us-east-1c/spot", "us-east-1c/spot",
        "us-east-1b/spot", "us-east-1b/spot",
    ]  # fmt: skip
    assert [o.instance_type for o in cands[:2]] == ["g5.xlarge", "g5.2xlarge"]


def test_on_demand_only_offers_are_used_without_fallback_and_limits_apply() -> None:
    od = [o for o in offers() if o.market is Market.ON_DEMAND]
    cands = get_strategy("same-zone-first").candidates(SPEC, od, on_demand_fallback=False, limit=2)
    assert labels(cands) == ["us-east-1b/on-demand", "us-east-1a/on-demand"]


def test_registry_by_name() -> None:
    assert set(STRATEGIES) >= {"same-zone-first", "eager-next-region"}
    for name, cls in STRATEGIES.items():
        assert cls.name == name
        assert cls.__doc__ and "Example" in cls.__doc__
    with pytest.raises(ConfigError, match="unknown recovery strategy 'cheapest-ever'"):
        get_strategy("cheapest-ever")
