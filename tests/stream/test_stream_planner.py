"""The deadline planner: choice of option, fallbacks, learning, THP detection."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spotguard.planner import (
    Estimate,
    Planner,
    PlannerSettings,
    estimate,
    set_thp,
    thp_status,
)

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


def test_the_estimate_of_a_job_with_no_gpu_device_open_does_not_ask_nvml() -> None:
    """``spotguard checkpoint`` estimates the job before it freezes it: a job none of whose
    processes has an NVIDIA device open holds no GPU memory, and NVML's bindings (~70 ms to
    import, before any GPU is asked about) are left unloaded on its path."""
    code = (
        "import os, sys\n"
        "from spotguard import nvml\n"
        "from spotguard.planner import estimate\n"
        "nvml.processes = lambda: sys.exit('NVML asked about a job with no GPU device open')\n"
        "est = estimate(os.getpid())\n"
        "print(est.gpu_bytes, 'pynvml' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "False"]


def test_ranks_checkpoint_at_once_once_the_host_rate_is_measured(tmp_path: Path) -> None:
    """Eight ranks of 4 GiB: serial until a run of several processes measured the host's
    combined rate; then the largest rank at one process's rate, bounded by the host's."""
    p = _planner(tmp_path, smoothing=1.0)
    one = Estimate(gpu_bytes=4 * GiB, cpu_bytes=0, processes=1)
    eight = Estimate(
        gpu_bytes=32 * GiB, cpu_bytes=0, processes=8, largest_gpu=4 * GiB, largest=4 * GiB
    )
    t1 = p.predict(one, mode="stream", level=1, store_url="file:///x")[0]["gpu_checkpoint"]
    t8 = p.predict(eight, mode="stream", level=1, store_url="file:///x")[0]["gpu_checkpoint"]
    assert t8 == pytest.approx(8 * t1)  # nothing measured on this host yet: serial
    plan = p.plan(eight, deadline_s=None, store_url="file:///x", parallel=True)
    # a measured run: all eight in 4 s (one rank's rate 1 GiB/s, the host's 8 GiB/s), the
    # stream of 32 GiB in 8 s with one pages file per rank at once
    p.record(
        plan,
        seconds={"gpu_checkpoint": 4.0, "stream": 8.0, "total": 12.0},
        raw_bytes=32 * GiB,
    )
    assert p.throughput["gpu_checkpoint"] == pytest.approx(GiB)
    assert p.throughput["gpu_checkpoint:host"] == pytest.approx(8 * GiB)
    assert p.throughput["stream:file:L1:host"] == pytest.approx(4 * GiB)
    stages, total = p.predict(eight, mode="stream", level=1, store_url="file:///x", parallel=True)
    assert stages["gpu_checkpoint"] == pytest.approx(4.0)
    assert stages["stream"] == pytest.approx(8.0)
    assert total == pytest.approx(12.0)
    # sixteen ranks on the same host: the host's combined rate now bounds both stages
    sixteen = Estimate(
        gpu_bytes=64 * GiB, cpu_bytes=0, processes=16, largest_gpu=4 * GiB, largest=4 * GiB
    )
    st16 = p.predict(sixteen, mode="stream", level=1, store_url="file:///x", parallel=True)[0]
    assert st16["gpu_checkpoint"] == pytest.approx(8.0)
    assert st16["stream"] == pytest.approx(16.0)
    # a CRIU that dumps one process after another streams every byte at one file's rate
    serial = p.predict(eight, mode="stream", level=1, store_url="file:///x", parallel=False)[0]
    assert serial["stream"] == pytest.approx(32 * GiB / p.throughput["stream:file:L1"])


def test_estimate_counts_the_ranks_of_a_launcher(tmp_path: Path) -> None:
    """A launcher (small) with two children holding 256 MiB each: two ranks, the largest
    ~256 MiB."""
    import subprocess
    import sys
    import time

    code = (
        "b=bytearray(256<<20)\nfor i in range(0,len(b),4096): b[i]=1\nimport time\ntime.sleep(60)"
    )
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess,sys\n"
            f"ps=[subprocess.Popen([sys.executable,'-c',{code!r}]) for _ in range(2)]\n"
            "[p.wait() for p in ps]",
        ]
    )
    try:
        deadline = time.monotonic() + 20
        est = estimate(launcher.pid)
        while est.cpu_bytes < 2 * (256 << 20) + (16 << 20) and time.monotonic() < deadline:
            time.sleep(0.2)
            est = estimate(launcher.pid)
        assert est.processes == 2
        assert (256 << 20) <= est.largest_bytes < (300 << 20)
        assert est.cpu_bytes > 2 * (256 << 20)
    finally:
        import psutil

        for c in psutil.Process(launcher.pid).children(recursive=True):
            c.kill()
        launcher.kill()
        launcher.wait()


def test_set_thp_writes_the_mode_once_and_keep_leaves_it(tmp_path: Path) -> None:
    thp = tmp_path / "sys/kernel/mm/transparent_hugepage"
    thp.mkdir(parents=True)
    enabled = thp / "enabled"
    enabled.write_text("always [madvise] never\n")
    assert set_thp("keep", sys_root=tmp_path).enabled == "madvise"
    assert enabled.read_text() == "always [madvise] never\n"
    set_thp("always", sys_root=tmp_path)
    assert enabled.read_text() == "always"  # what the kernel is given; it shows [always]
    enabled.write_text("[always] madvise never\n")
    assert set_thp("always", sys_root=tmp_path).enabled == "always"
    assert enabled.read_text() == "[always] madvise never\n"  # already so: not written


def test_set_thp_that_cannot_write_keeps_the_mode_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    thp = tmp_path / "sys/kernel/mm/transparent_hugepage"
    thp.mkdir(parents=True)
    # readable, but no one (root included) may write it: like sysfs in a container
    (thp / "enabled").symlink_to("/proc/version")
    caplog.set_level("WARNING")
    before = set_thp("keep", sys_root=tmp_path).enabled
    assert set_thp("always", sys_root=tmp_path).enabled == before != "always"
    assert "stay as the host has them" in caplog.text


def test_gpu_memory_carried_beside_criu_is_predicted_at_its_own_rate(tmp_path: Path) -> None:
    """A fresh machine's prediction of a 40 GiB job whose GPU memory spotguard copies beside
    CRIU (``gpu_pages``): CRIU's rate applies to the CPU memory only (measured on an H200: 22.6
    s freeze → durable, where the prediction through CRIU said 172 s, docs/benchmarks.md)."""
    p = _planner(tmp_path, smoothing=1.0)
    est = Estimate(gpu_bytes=41 * 10**9, cpu_bytes=650 * 10**6)
    through_criu = p.predict(est, mode="stream", level=1, store_url="file:///x")[1]
    stages, beside = p.predict(est, mode="stream", level=1, store_url="file:///x", beside=True)
    assert through_criu > 100
    assert set(stages) >= {"gpu_checkpoint", "gpu_pages", "criu_dump", "stream"}
    assert stages["criu_dump"] == pytest.approx(est.cpu_bytes / p.throughput["criu_dump"])
    assert 22.6 < beside < through_criu  # conservative, CRIU's rate on the CPU memory only
    pipe = max(stages[k] for k in ("criu_dump", "compress", "upload", "gpu_pages"))
    assert beside == pytest.approx(stages["gpu_checkpoint"] + pipe)
    # on a store whose writes this machine measured (tmpfs, 8 GB/s), the copy's rate shows
    p.throughput["upload:file"] = 8e9
    fast = p.predict(est, mode="stream", level=1, store_url="file:///x", beside=True)
    assert fast[0]["stream"] == pytest.approx(fast[0]["gpu_pages"])
    assert fast[1] < 40
    # a run teaches the copy's own rate; the learned stream rate then covers every byte
    plan = p.plan(est, deadline_s=None, store_url="file:///x", beside=True)
    assert plan.beside and plan.stages == fast[0]
    secs = {"gpu_checkpoint": 13.3, "gpu_pages": 5.3, "stream": 6.6, "total": 22.6}
    p.record(plan, seconds=secs, raw_bytes=est.total)
    assert p.throughput["gpu_pages"] == pytest.approx(est.gpu_bytes / 5.3)
    again = p.predict(est, mode="stream", level=1, store_url="file:///x", beside=True)[1]
    assert again == pytest.approx(13.3 + 6.6, rel=0.05)


def test_a_staged_image_beside_criu_still_compresses_every_byte(tmp_path: Path) -> None:
    p = _planner(tmp_path)
    est = Estimate(gpu_bytes=8 * GiB, cpu_bytes=GiB)
    stages, total = p.predict(est, mode="stage", level=1, store_url="s3://b/p", beside=True)
    assert stages["criu_dump"] == pytest.approx(GiB / p.throughput["criu_dump"])
    whole = p.predict(est, mode="stage", level=1, store_url="s3://b/p")[0]
    assert stages["compress"] == pytest.approx(whole["compress"])
    assert stages["upload"] == pytest.approx(whole["upload"])
    assert total == pytest.approx(sum(stages.values()))
