"""Prometheus metrics of one agent, served at ``/metrics``.

Named by Prometheus' conventions: a ``spotguard_`` prefix, the unit as a suffix
(``_seconds``, ``_bytes``, ``_events``, ``_jobs``), ``_total`` on counters, and no label that
a scrape overwrites — the job a series is about is ``spotguard_job``, never ``job`` (which
Prometheus sets to the scrape job, renaming ours to ``exported_job``). Besides the checkpoint
path's own series there are ``spotguard_build_info{version,python}``, the standard
``process_*`` series (CPU, memory, open files) and ``spotguard_protected_jobs``.

Each :class:`AgentMetrics` owns its registry (no process-global state), so several agents can
run in one process (tests) and nothing else leaks into the scrape. :data:`METRICS` lists every
name served, for the dashboard check (``packaging/grafana/spotguard.json``).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: the label naming the job a series is about (``job`` belongs to Prometheus)
JOB_LABEL = "spotguard_job"

_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)

#: every metric family an agent serves, as scraped (counters with ``_total``)
METRICS: tuple[str, ...] = (
    "spotguard_build_info",
    "spotguard_notices_total",
    "spotguard_freeze_seconds",
    "spotguard_pause_seconds",
    "spotguard_notice_to_frozen_seconds",
    "spotguard_checkpoint_bytes_total",
    "spotguard_dedup_skipped_bytes_total",
    "spotguard_upload_throughput_bytes_per_second",
    "spotguard_checkpoints_total",
    "spotguard_failures_total",
    "spotguard_kept_images",
    "spotguard_report_queue_events",
    "spotguard_protected_jobs",
    "spotguard_last_image_age_seconds",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_open_fds",
    "process_start_time_seconds",
)


def spotguard_version() -> str:
    try:
        return version("spotguard")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


class _ImageAge(Collector):
    """``spotguard_last_image_age_seconds{spotguard_job}`` computed at scrape time."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def collect(self) -> list[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "spotguard_last_image_age_seconds",
            "Seconds since the newest durable image of the job was frozen",
            labels=[JOB_LABEL],
        )
        now = time.time()
        for job, at in sorted(self.last.items()):
            g.add_metric([job], max(0.0, now - at))
        return [g]


class _Parked(Collector):
    """Parked jobs of this node and the bytes of state they hold, by place."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def collect(self) -> list[GaugeMetricFamily]:
        from spotguard.park import record

        jobs = GaugeMetricFamily(
            "spotguard_parked_jobs", "Jobs parked on this node", labels=["place"]
        )
        held = GaugeMetricFamily(
            "spotguard_parked_bytes",
            "Bytes of state parked jobs hold (memory, tmpfs, disk or store)",
            labels=["place"],
        )
        count: dict[str, int] = {}
        size: dict[str, int] = {}
        for rec in record.all_records(self.state_dir):
            count[rec.place] = count.get(rec.place, 0) + 1
            size[rec.place] = size.get(rec.place, 0) + rec.bytes
        for place in ("memory", "tmpfs", "disk", "store"):
            jobs.add_metric([place], float(count.get(place, 0)))
            held.add_metric([place], float(size.get(place, 0)))
        return [jobs, held]


class AgentMetrics:
    """The agent's counters, histograms and gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        j = JOB_LABEL
        info = Gauge(
            "spotguard_build_info",
            "Always 1; the labels say which spotguard and Python this agent runs",
            ["version", "python"],
            registry=r,
        )
        info.labels(spotguard_version(), platform.python_version()).set(1)
        ProcessCollector(registry=r)
        self.notices = Counter("spotguard_notices", "Notices seen", ["cloud", "kind"], registry=r)
        self.freeze_seconds = Histogram(
            "spotguard_freeze_seconds",
            "Freeze window: seconds from the freeze's start until the state is in host memory",
            [j, "mode"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.pause_seconds = Histogram(
            "spotguard_pause_seconds",
            "Seconds a job stood still for a checkpoint it resumed from",
            [j],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.notice_to_frozen = Histogram(
            "spotguard_notice_to_frozen_seconds",
            "Seconds from a notice being seen until the job's state is in host memory",
            [j],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.checkpoint_bytes = Counter(
            "spotguard_checkpoint_bytes", "Image bytes written (before dedup)", [j], registry=r
        )
        self.dedup_bytes = Counter(
            "spotguard_dedup_skipped_bytes",
            "Image bytes not uploaded because the store already had them",
            [j],
            registry=r,
        )
        self.upload_throughput = Gauge(
            "spotguard_upload_throughput_bytes_per_second",
            "Image bytes per second of the last checkpoint, freeze start to durable",
            [j],
            registry=r,
        )
        self.checkpoints = Counter(
            "spotguard_checkpoints", "Durable checkpoints", [j, "mode"], registry=r
        )
        self.failures = Counter("spotguard_failures", "Failures by step", ["step"], registry=r)
        self.kept_images = Gauge(
            "spotguard_kept_images",
            "Staged images of stopped jobs waiting for the store (pushed again until durable)",
            registry=r,
        )
        self.report_queue = Gauge(
            "spotguard_report_queue_events",
            "Controller reports (events) waiting to be delivered",
            registry=r,
        )
        self.protected_jobs = Gauge(
            "spotguard_protected_jobs",
            "Jobs the agent protects now (running, watched, checkpointed on a notice)",
            registry=r,
        )
        self.protected_jobs.set_function(lambda: 0.0)
        self._age = _ImageAge()
        r.register(self._age)

    def count_parked(self, state_dir: Path) -> None:
        """``spotguard_parked_jobs`` and ``spotguard_parked_bytes``, read from the park records
        at each scrape."""
        self.registry.register(_Parked(state_dir))

    def count_protected(self, count: Callable[[], int]) -> None:
        """Let ``spotguard_protected_jobs`` ask ``count`` at each scrape."""
        self.protected_jobs.set_function(lambda: float(count()))

    def image_durable(self, job: str, frozen_at: float) -> None:
        """Record the newest durable image's freeze time for the age gauge."""
        if frozen_at > self._age.last.get(job, 0.0):
            self._age.last[job] = frozen_at

    def render(self) -> bytes:
        return generate_latest(self.registry)
