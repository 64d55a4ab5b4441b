"""Prometheus metrics of one agent, served at ``/metrics``.

Each :class:`AgentMetrics` owns its registry (no process-global state), so several agents can
run in one process (tests) and nothing else leaks into the scrape.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class _ImageAge(Collector):
    """``spotguard_last_image_age_seconds{job}`` computed at scrape time."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def collect(self) -> list[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "spotguard_last_image_age_seconds",
            "Seconds since the newest durable image of the job was frozen",
            labels=["job"],
        )
        now = time.time()
        for job, at in sorted(self.last.items()):
            g.add_metric([job], max(0.0, now - at))
        return [g]


class AgentMetrics:
    """The agent's counters, histograms and gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.notices = Counter("spotguard_notices", "Notices seen", ["cloud", "kind"], registry=r)
        self.freeze_seconds = Histogram(
            "spotguard_freeze_seconds",
            "Freeze window: seconds from the freeze's start until the state is in host memory",
            ["job", "mode"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.pause_seconds = Histogram(
            "spotguard_pause_seconds",
            "Seconds a job stood still for a checkpoint it resumed from",
            ["job"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.notice_to_frozen = Histogram(
            "spotguard_notice_to_frozen_seconds",
            "Seconds from a notice being seen until the job's state is in host memory",
            ["job"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.checkpoint_bytes = Counter(
            "spotguard_checkpoint_bytes", "Image bytes written (before dedup)", ["job"], registry=r
        )
        self.dedup_bytes = Counter(
            "spotguard_dedup_skipped_bytes",
            "Image bytes not uploaded because the store already had them",
            ["job"],
            registry=r,
        )
        self.upload_throughput = Gauge(
            "spotguard_upload_throughput_bytes_per_second",
            "Image bytes per second of the last checkpoint, freeze start to durable",
            ["job"],
            registry=r,
        )
        self.checkpoints = Counter(
            "spotguard_checkpoints", "Durable checkpoints", ["job", "mode"], registry=r
        )
        self.failures = Counter("spotguard_failures", "Failures by step", ["step"], registry=r)
        self.kept_images = Gauge(
            "spotguard_kept_images",
            "Staged images of stopped jobs waiting for the store (pushed again until durable)",
            registry=r,
        )
        self.report_queue = Gauge(
            "spotguard_report_queue", "Controller reports waiting to be delivered", registry=r
        )
        self._age = _ImageAge()
        r.register(self._age)

    def image_durable(self, job: str, frozen_at: float) -> None:
        """Record the newest durable image's freeze time for the age gauge."""
        if frozen_at > self._age.last.get(job, 0.0):
            self._age.last[job] = frozen_at

    def render(self) -> bytes:
        return generate_latest(self.registry)
