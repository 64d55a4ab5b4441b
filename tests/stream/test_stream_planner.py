"""The deadline planner: choice of option, fallbacks, learning, THP detection."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from spotguard.planner import Estimate, Planner, PlannerSettings, estimate, thp_status

GiB = 1 << 30


def _planner(tmp_path: Path, **kw: object) -> Planner:
    settings = PlannerSettings(throughput_file=tmp_path / "tp.json", **kw)  # type: ignore[arg-type]
    return Planner(settings, threads=2)


def test_streaming_predicts_less_than_staging(tmp_path: Path) -> None:
    p = _planner(tmp_path)
    est = Estimate(gpu_bytes=10 * GiB, cpu_bytes=GiB)
    _, stream = p.predict(est, mode="stream", level=1, store_url="s3://b/p")
    stages, stage = p.predict(est, mode="stage", level=1, store_url="s3://b/p")
    assert stream < stage
    assert stage == pytest.approx(sum(stages.values()))


def test_plan_falls_back_to_a_faster_level_then_reports_it_cannot_fit(tmp_path: Path) -> None:
    p = _planner(tmp_path, levels=[9, 1], margin_s=0)
    est = Estimate(cpu_bytes=GiB)
    slow = p.predict(est, mode="stream", level=9, store_url="file:///x")[1]
    fast = p.predict(est, mode="stream", level=1, store_url="file:///x")[1]
    assert fast < slow
    plan = p.plan(est, deadline_s=(fast + slow) / 2, store_url="file:///x")
    assert plan.fits and plan.level == 1 and "level 1 fits" in plan.reason
    hopeless = p.plan(est, deadline_s=fast / 10, store_url="file:///x")
    assert not hopeless.fits and hopeless.level == 1 and "cannot be durable" in hopeless.reason
    periodic = _planner(tmp_path, levels=[1], fallback="periodic").plan(
        est, deadline_s=0.1, store_url="file:///x"
    )
    assert periodic.mode == "keep-periodic" and not periodic.fits


def test_record_learns_and_persists_throughputs(tmp_path: Path) -> None:
    p = _planner(tmp_path, smoothing=1.0)
    est = Estimate(cpu_bytes=GiB)
    plan = p.plan(est, deadline_s=None, store_url="file:///x")
    p.record(plan, seconds={"stream": 2.0, "total": 2.5}, raw_bytes=GiB, stored_bytes=GiB // 2)
    data = json.loads((tmp_path / "tp.json").read_text())
    assert data["throughput"]["stream:file:L1"] == pytest.approx(GiB / 2.0)
    assert data["ratio"]["L1"] == pytest.approx(2.0)
    again = _planner(tmp_path)
    _, total = again.predict(est, mode="stream", level=1, store_url="file:///x")
    assert total == pytest.approx(2.0)  # the measured pipeline speed now drives predictions
    assert plan.actual == {"stream": 2.0, "total": 2.5}


def test_unreadable_throughput_file_falls_back_to_defaults(tmp_path: Path) -> None:
    (tmp_path / "tp.json").write_text("not json")
    p = _planner(tmp_path)
    assert p.runs == 0 and p.throughput["criu_dump"] > 0


def test_thp_status_reads_sysfs_and_smaps(tmp_path: Path) -> None:
    thp = tmp_path / "sys/kernel/mm/transparent_hugepage"
    thp.mkdir(parents=True)
    (thp / "enabled").write_text("always [madvise] never\n")
    (thp / "defrag").write_text("[always] defer defer+madvise madvise never\n")
    proc = tmp_path / "proc/42"
    proc.mkdir(parents=True)
    (proc / "smaps_rollup").write_text("Rss:  1000 kB\nAnonHugePages:  2048 kB\n")
    st = thp_status(42, sys_root=tmp_path)
    assert (st.enabled, st.defrag, st.anon_huge_bytes) == ("madvise", "always", 2048 * 1024)
    assert thp_status(sys_root=tmp_path / "none").enabled is None


def test_estimate_of_this_process_counts_its_memory() -> None:
    est = estimate(os.getpid())
    assert est.cpu_bytes > 10 << 20 and est.gpu_bytes == 0
