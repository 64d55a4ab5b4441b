"""Deadline planner: before freezing, predict whether the image can be durable in time.

Inputs: the notice's deadline, size estimates (GPU memory the job holds, from NVML; the RSS of
its process tree, from psutil), and per-stage throughputs measured by earlier runs on this
machine (a JSON file in the state dir, starting from conservative defaults taken from our
measurements). Output: a :class:`Plan` — predicted seconds per stage and in total, whether it
fits, which option was chosen and why — logged before the freeze. After the run,
:meth:`Planner.record` logs the actual next to the prediction and folds the measured
throughputs into the file, so the next prediction on this machine is better.

Streaming overlaps the CRIU dump with compression and upload, so its prediction is the GPU
checkpoint plus the slowest of the overlapped stages; staging adds them up. When nothing fits,
the planner says so at once and picks the configured fallback: the fastest codec level (try
anyway, best effort) or keep the newest periodic image (and tell the controller).

Transparent huge pages speed up every stage (1.3 to 1.5 times, measured on the H100 machine);
:func:`thp_status` reads the host setting and a job's huge-page use so reports can show it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from spotguard.config import Settings
from spotguard.errors import ConfigError

log = logging.getLogger(__name__)

GB = 1e9
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_DEFRAG = Path("/sys/kernel/mm/transparent_hugepage/defrag")

#: Conservative starting throughputs (bytes/s) until this machine has measured its own.
#: From docs of our measurements (shared notes): driver checkpoint ~1.8 GB/s, CRIU dump
#: 0.3 GB/s on a 2-core VM (1.9 GB/s on the H100 VM), zstd level 1 ~0.5 GB/s per thread on CPU
#: pages, moto S3 ~0.07 GB/s, real S3/GCS from a GPU VM well above that.
DEFAULT_THROUGHPUT: dict[str, float] = {
    "gpu_checkpoint": 1.8 * GB,
    "criu_dump": 0.3 * GB,
    "compress_per_thread": 0.5 * GB,
    "upload:file": 0.5 * GB,
    "upload:s3": 0.2 * GB,
    "upload:gs": 0.2 * GB,
}
DEFAULT_RATIO = 1.0  # compressed = raw / ratio; 1.0 assumes nothing compresses


class PlannerSettings(Settings):
    """``[planner]``: how close to the deadline to plan and what to do when it cannot fit."""

    section: ClassVar[str] = "planner"

    margin_s: float = Field(
        3.0, ge=0, description="Seconds kept free before the deadline when judging a plan"
    )
    levels: list[int] = Field(
        default_factory=lambda: [1, -1, -5],
        description="zstd levels to try in order of preference (faster ones later)",
    )
    fallback: Literal["fastest", "periodic"] = Field(
        "fastest",
        description=(
            "When nothing fits: 'fastest' streams with the fastest level anyway; 'periodic' "
            "keeps the newest periodic image and reports it"
        ),
    )
    throughput_file: Path | None = Field(
        None, description="Measured stage throughputs (default: <state dir>/throughput.json)"
    )
    smoothing: float = Field(
        0.5, gt=0, le=1, description="Weight of the newest run when updating throughputs"
    )


@dataclass(frozen=True)
class Estimate:
    """How big the image will be: GPU memory the job holds and its CPU-side memory."""

    gpu_bytes: int = 0
    cpu_bytes: int = 0
    source: str = ""

    @property
    def total(self) -> int:
        return self.gpu_bytes + self.cpu_bytes


@dataclass(frozen=True)
class ThpStatus:
    """Transparent huge pages: the host's mode and (for a job) anonymous memory in huge pages."""

    enabled: str | None  # "always", "madvise", "never", or None when the kernel has no THP
    defrag: str | None
    anon_huge_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _bracketed(path: Path) -> str | None:
    """The selected word of a sysfs choice file (``always [madvise] never`` → madvise)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return text.strip() or None


def thp_status(pid: int | None = None, *, sys_root: Path = Path("/")) -> ThpStatus:
    """Read the host's THP mode and, for ``pid``, its AnonHugePages (smaps_rollup)."""
    base = sys_root / "sys/kernel/mm/transparent_hugepage"
    huge: int | None = None
    if pid is not None:
        try:
            for line in (sys_root / f"proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("AnonHugePages:"):
                    huge = int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            huge = None
    return ThpStatus(
        enabled=_bracketed(base / "enabled"),
        defrag=_bracketed(base / "defrag"),
        anon_huge_bytes=huge,
    )


def tree_rss(pid: int) -> int:
    """Resident memory of a process and all its descendants (what CRIU will dump)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def gpu_bytes_of(pids: set[int]) -> int:
    """GPU memory the given processes hold, by NVML; 0 where there is no NVML or GPU."""
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0
    total = 0
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in pids and proc.usedGpuMemory:
                    total += int(proc.usedGpuMemory)
    except pynvml.NVMLError as exc:
        log.warning("NVML could not list GPU processes: %s", exc)
    finally:
        pynvml.nvmlShutdown()
    return total


def estimate(pid: int) -> Estimate:
    """Estimate the image of the job rooted at ``pid``.

    The GPU side ends up in host memory at checkpoint time and CRIU dumps both, so the image
    is about GPU bytes + RSS (measured: 98.5% GPU memory for a PyTorch trainer).
    """
    import psutil

    try:
        root = psutil.Process(pid)
        pids = {pid, *(c.pid for c in root.children(recursive=True))}
    except psutil.Error:
        pids = {pid}
    gpu = gpu_bytes_of(pids)
    return Estimate(
        gpu_bytes=gpu, cpu_bytes=tree_rss(pid), source="nvml+psutil" if gpu else "psutil"
    )


@dataclass
class Plan:
    """A prediction made before freezing, and (after :meth:`Planner.record`) the actual."""

    mode: Literal["stream", "stage", "keep-periodic"]
    level: int
    store_scheme: str
    estimate: Estimate
    deadline_s: float | None  # seconds left when planned; None = no deadline
    stages: dict[str, float] = field(default_factory=dict)  # predicted seconds per stage
    total_s: float = 0.0
    fits: bool = True
    reason: str = ""
    thp: ThpStatus | None = None
    actual: dict[str, float] | None = None
    planned_at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["estimate"]["total"] = self.estimate.total
        return d


def _scheme(store_url: str) -> str:
    if "://" not in store_url:
        return "file"
    return store_url.split("://", 1)[0]


class Planner:
    """Predict, choose, and learn stage throughputs on this machine."""

    def __init__(
        self,
        settings: PlannerSettings,
        *,
        state_dir: Path | None = None,
        threads: int | None = None,
    ) -> None:
        """``settings`` are the ``[planner]`` settings loaded at the edge; the measurements
        live in ``throughput_file``, else in ``state_dir``/throughput.json."""
        self.settings = settings
        if not self.settings.levels:
            raise ConfigError("planner.levels must name at least one zstd level")
        path = self.settings.throughput_file
        if path is None:
            if state_dir is None:
                raise ConfigError("the planner needs throughput_file or a state directory")
            path = state_dir / "throughput.json"
        self.path = path
        self.threads = threads or os.cpu_count() or 1
        self.throughput: dict[str, float] = dict(DEFAULT_THROUGHPUT)
        self.ratio: dict[str, float] = {}
        self.runs = 0
        self._load()

    # --- persisted measurements ------------------------------------------------------------
    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable throughput file %s: %s", self.path, exc)
            return
        if not isinstance(data, dict):
            log.warning("ignoring throughput file %s: not an object", self.path)
            return
        for key, val in dict(data.get("throughput", {})).items():
            if isinstance(val, int | float) and val > 0:
                self.throughput[str(key)] = float(val)
        for key, val in dict(data.get("ratio", {})).items():
            if isinstance(val, int | float) and val > 0:
                self.ratio[str(key)] = float(val)
        self.runs = int(data.get("runs", 0))

    def save(self) -> None:
        """Write the measurements atomically (a crash never leaves half a file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        body = {
            "throughput": self.throughput,
            "ratio": self.ratio,
            "runs": self.runs,
            "updated": time.time(),
            "thp": thp_status().enabled,
        }
        tmp.write_text(json.dumps(body, indent=2, sort_keys=True))
        os.replace(tmp, self.path)

    # --- prediction --------------------------------------------------------------------------
    def _compress(self, level: int) -> float:
        key = f"compress:L{level}"
        if key in self.throughput:
            return self.throughput[key]
        # Faster levels compress faster; without a measurement assume level 1's speed
        # (conservative for negative levels, optimistic for > 3 — which we only scale down).
        per_thread = self.throughput["compress_per_thread"]
        slow = max(1.0, (level - 1) / 2) if level > 1 else 1.0
        return per_thread * self.threads / slow

    def _upload(self, scheme: str) -> float:
        return self.throughput.get(f"upload:{scheme}", self.throughput["upload:s3"])

    def predict(
        self, est: Estimate, *, mode: Literal["stream", "stage"], level: int, store_url: str
    ) -> tuple[dict[str, float], float]:
        """Predicted seconds per stage and in total for one option."""
        scheme = _scheme(store_url)
        ratio = self.ratio.get(f"L{level}", DEFAULT_RATIO)
        gpu = est.gpu_bytes / self.throughput["gpu_checkpoint"] if est.gpu_bytes else 0.0
        stages = {
            "gpu_checkpoint": gpu,
            "criu_dump": est.total / self.throughput["criu_dump"],
            "compress": est.total / self._compress(level),
            "upload": est.total / ratio / self._upload(scheme),
        }
        measured = self.throughput.get(f"stream:{scheme}:L{level}")
        if mode == "stream":
            # Overlapped: the pipeline runs at its slowest stage (or as measured before).
            pipe = (
                est.total / measured
                if measured
                else max(stages["criu_dump"], stages["compress"], stages["upload"])
            )
            stages["stream"] = pipe
            total = gpu + pipe
        else:
            total = sum(stages.values())
        return stages, total

    def plan(
        self,
        est: Estimate,
        *,
        deadline_s: float | None,
        store_url: str,
        stream: bool = True,
        pid: int | None = None,
    ) -> Plan:
        """Choose how to freeze: the first level that fits the deadline, else the fallback.

        Logs the plan (one line, with every stage) before anything is frozen.
        """
        mode: Literal["stream", "stage"] = "stream" if stream else "stage"
        thp = thp_status(pid)
        scheme = _scheme(store_url)
        candidates: list[Plan] = []
        for level in self.settings.levels:
            stages, total = self.predict(est, mode=mode, level=level, store_url=store_url)
            fits = deadline_s is None or total + self.settings.margin_s <= deadline_s
            candidates.append(
                Plan(mode, level, scheme, est, deadline_s, stages, total, fits, "", thp)
            )
        chosen = next((p for p in candidates if p.fits), None)
        if chosen is not None:
            first = chosen is candidates[0]
            chosen.reason = (
                "fits"
                if deadline_s is None or first
                else f"level {candidates[0].level} would need {candidates[0].total_s:.1f}s; "
                f"level {chosen.level} fits"
            )
        else:
            fastest = min(candidates, key=lambda p: p.total_s)
            if self.settings.fallback == "periodic":
                chosen = Plan(
                    "keep-periodic", fastest.level, scheme, est, deadline_s, fastest.stages,
                    fastest.total_s, False, "", thp,
                )  # fmt: skip
                chosen.reason = (
                    f"cannot be durable in time ({fastest.total_s:.1f}s needed, "
                    f"{deadline_s:.1f}s left): keeping the newest periodic image"
                )
            else:
                chosen = fastest
                chosen.reason = (
                    f"cannot be durable in time ({fastest.total_s:.1f}s needed, "
                    f"{deadline_s:.1f}s left): trying the fastest level {fastest.level} anyway"
                )
        level_fn = log.info if chosen.fits else log.warning
        level_fn(
            "plan: %s level %d, %.1fs predicted, %s",
            chosen.mode,
            chosen.level,
            chosen.total_s,
            chosen.reason,
            extra={
                "plan": {k: round(v, 3) for k, v in chosen.stages.items()},
                "deadline_s": deadline_s,
                "image_bytes": est.total,
                "gpu_bytes": est.gpu_bytes,
                "fits": chosen.fits,
                "thp": thp.enabled,
            },
        )
        return chosen

    # --- learning ------------------------------------------------------------------------------
    def _fold(self, key: str, value: float) -> None:
        if value <= 0:
            return
        old = self.throughput.get(key)
        a = self.settings.smoothing
        self.throughput[key] = value if old is None else (1 - a) * old + a * value

    def record(
        self,
        plan: Plan,
        *,
        seconds: dict[str, float],
        raw_bytes: int,
        stored_bytes: int | None = None,
        gpu_bytes: int | None = None,
        save: bool = True,
    ) -> Plan:
        """Log the actual next to the prediction and learn from it.

        ``seconds`` holds measured stage durations: ``gpu_checkpoint``, ``criu_dump``,
        ``compress``, ``upload`` for staged runs, ``stream`` (CRIU start → image durable) for
        streamed runs, and ``total`` (freeze start → durable) for both.
        """
        plan.actual = dict(seconds)
        g = gpu_bytes if gpu_bytes is not None else plan.estimate.gpu_bytes
        if g and seconds.get("gpu_checkpoint"):
            self._fold("gpu_checkpoint", g / seconds["gpu_checkpoint"])
        if raw_bytes:
            if plan.mode == "stream" and seconds.get("stream"):
                key = f"stream:{plan.store_scheme}:L{plan.level}"
                self._fold(key, raw_bytes / seconds["stream"])
            for stage, key in (
                ("criu_dump", "criu_dump"),
                ("compress", f"compress:L{plan.level}"),
                ("upload", f"upload:{plan.store_scheme}"),
            ):
                if plan.mode == "stage" and seconds.get(stage):
                    nbytes = raw_bytes
                    if stage == "upload" and stored_bytes:
                        nbytes = stored_bytes
                    self._fold(key, nbytes / seconds[stage])
            if stored_bytes:
                r = raw_bytes / stored_bytes
                old = self.ratio.get(f"L{plan.level}")
                self.ratio[f"L{plan.level}"] = r if old is None else (old + r) / 2
        self.runs += 1
        actual = seconds.get("total", 0.0)
        log.info(
            "plan vs actual: predicted %.1fs, took %.1fs",
            plan.total_s,
            actual,
            extra={
                "predicted": {k: round(v, 3) for k, v in plan.stages.items()},
                "actual": {k: round(v, 3) for k, v in seconds.items()},
                "deadline_s": plan.deadline_s,
                "met": plan.deadline_s is None or actual <= plan.deadline_s,
            },
        )
        if save:
            try:
                self.save()
            except OSError as exc:
                log.warning("could not save throughputs to %s: %s", self.path, exc)
        return plan
