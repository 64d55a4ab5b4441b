"""The controller's Prometheus metrics (events, launches, duplicates, stale reports, jobs by
state), in a registry of their own so that several controllers can live in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class Metrics:
    """Prometheus metrics of one controller (own registry, so several can live in a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.events = Counter(
            "spotguard_controller_events", "Agent events applied", ["kind"], registry=self.registry
        )
        self.launches = Counter(
            "spotguard_controller_launches",
            "Launch attempts by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.duplicates = Counter(
            "spotguard_controller_duplicate_events",
            "Events that repeated news already applied (retried reports; a notice reported "
            "by both the agent and the fleet queue)",
            ["kind"],
            registry=self.registry,
        )
        self.stale = Counter(
            "spotguard_controller_stale_events",
            "Events from a sender that no longer owns the job (recorded and ignored)",
            ["kind"],
            registry=self.registry,
        )
        self.jobs = Gauge(
            "spotguard_controller_jobs", "Jobs by state", ["state"], registry=self.registry
        )
