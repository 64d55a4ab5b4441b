"""Issue 17.5: metrics follow Prometheus' conventions, and the Grafana dashboard in the repo
only queries series that exist.

* no ``job`` label (Prometheus' own target label: a default scrape renamed ours to
  ``exported_job``, so ``{job="train"}`` alerts never matched) — the job is ``spotguard_job``;
* units in names, ``spotguard_build_info``, the process collector, a protected-jobs gauge;
* every panel of ``packaging/grafana/spotguard-dashboard.json`` names existing metrics and
  labels.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import tempfile
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from spotguard.agent.daemon import Agent
from spotguard.agent.metrics import JOB_LABEL, METRICS, AgentMetrics
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.controller.core import Metrics as ControllerMetrics
from spotguard.image.settings import ImageSettings
from spotguard.notices.settings import NoticeSettings

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "packaging" / "grafana" / "spotguard-dashboard.json"
TARGET_LABELS = {"job", "instance", "le"}  # set by Prometheus itself, or histogram buckets


def agent_scrape() -> str:
    """An agent's scrape with one series of each labelled family."""
    m = AgentMetrics()
    m.notices.labels("aws", "preempt").inc()
    m.freeze_seconds.labels("train", "exit").observe(0.2)
    m.pause_seconds.labels("train").observe(0.2)
    m.notice_to_frozen.labels("train").observe(0.3)
    m.checkpoint_bytes.labels("train").inc(10)
    m.dedup_bytes.labels("train").inc(5)
    m.upload_throughput.labels("train").set(100)
    m.checkpoints.labels("train", "exit").inc()
    m.failures.labels("upload").inc()
    m.image_durable("train", 1.0)
    with tempfile.TemporaryDirectory() as state_dir:  # the parked-job gauges (no park: 0)
        m.count_parked(Path(state_dir))
        return m.render().decode()


def controller_scrape() -> str:
    c = ControllerMetrics()
    c.events.labels("durable").inc()
    c.launches.labels("launched").inc()
    c.duplicates.labels("notice").inc()
    c.jobs.labels("failed").set(0)
    from prometheus_client import generate_latest

    return generate_latest(c.registry).decode()


def series(text: str) -> dict[str, set[str]]:
    """sample name → label names, from a scrape."""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def test_agent_metrics_follow_prometheus_conventions() -> None:
    scraped = series(agent_scrape())
    families = {f.name for f in text_string_to_metric_families(agent_scrape())}
    for name, labels in scraped.items():
        assert name.startswith(("spotguard_", "process_")), name
        assert "job" not in labels, f"{name} uses Prometheus' own 'job' label"
    assert {"spotguard_checkpoints_total", "spotguard_last_image_age_seconds"} <= set(scraped)
    assert JOB_LABEL in scraped["spotguard_checkpoints_total"]
    assert "spotguard_report_queue_events" in scraped  # a unit, not a bare "queue"
    assert "spotguard_report_queue" not in families
    (info,) = [
        f for f in text_string_to_metric_families(agent_scrape()) if f.name.endswith("build_info")
    ]
    assert info.samples[0].value == 1 and set(info.samples[0].labels) == {"version", "python"}
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"):
        assert name in scraped
    assert set(METRICS) <= set(scraped) | families, "METRICS lists only what is served"


async def test_the_agent_serves_its_protected_jobs(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    """A real agent protecting a real process: /metrics over HTTP counts it."""
    job = sleeper
    agent = Agent(
        AgentSettings(
            job=[str(job.pid)], store=(tmp_path / "s").as_uri(), api_listen="127.0.0.1:0"
        ),
        CheckpointSettings(state_dir=tmp_path / "state"),
        NoticeSettings(cloud="none"),
        image=ImageSettings(),
    )
    run = asyncio.create_task(agent.run())
    try:
        text = ""
        async with aiohttp.ClientSession() as http:
            for _ in range(100):
                await asyncio.sleep(0.1)
                if agent.api is None or agent.api.address.endswith(":0"):
                    continue
                async with http.get(f"http://{agent.api.address}/metrics") as resp:
                    text = await resp.text()
                if "spotguard_protected_jobs 1.0" in text:
                    break
        assert "spotguard_protected_jobs 1.0" in text, text
        assert "spotguard_build_info{" in text and "process_open_fds" in text
    finally:
        agent.request_stop()
        await asyncio.wait_for(run, 30)


def _metric_names(expr: str) -> set[str]:
    """Metric names of a PromQL expression (label names in by/without/{} left out)."""
    bare = re.sub(r"\b(?:by|without)\s*\([^)]*\)|\{[^}]*\}", " ", expr)
    return set(re.findall(r"\b((?:spotguard|process)_[a-z_]+)\b", bare))


def _label_names(expr: str) -> set[str]:
    names = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        names |= {g.strip() for g in group.split(",") if g.strip()}
    for group in re.findall(r"\{([^}]*)\}", expr):
        names |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", group))
    return names


def test_every_dashboard_panel_queries_existing_metrics_and_labels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    scraped = series(agent_scrape()) | series(controller_scrape())
    exprs = [
        (p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", []) if t["expr"]
    ]
    assert len(exprs) >= 15
    used: set[str] = set()
    for title, expr in exprs:
        names = _metric_names(expr)
        assert names, f"panel {title!r} queries no spotguard metric: {expr}"
        labels: set[str] = set()
        for name in names:
            assert name in scraped, f"panel {title!r}: no metric {name}"
            labels |= scraped[name]
        unknown = _label_names(expr) - labels - TARGET_LABELS
        assert not unknown, f"panel {title!r}: labels {unknown} are on none of {names}"
        used |= names
    for var in dash["templating"]["list"]:
        for name in _metric_names(str(var.get("query", ""))):
            assert name in scraped, f"variable {var['name']}: no metric {name}"
    assert "spotguard_protected_jobs" in used and "spotguard_build_info" in used
    assert {"spotguard_parked_jobs", "spotguard_parked_bytes"} <= used  # the park panels
