"""Deadline planner: before freezing, predict whether the image can be durable in time.

Inputs: the notice's deadline, size estimates (GPU memory the job holds, from NVML; the RSS of
its process tree, from psutil), and per-stage throughputs measured by earlier runs on this
machine (a JSON file in the state dir, starting from conservative defaults taken from our
measurements). Output: a :class:`Plan` — predicted seconds per stage and in total, whether it
fits, which option was chosen and why — logged before the freeze. After the run,
:meth:`Planner.record` logs the actual next to the prediction and folds the measured
throughputs into the file, so the next prediction on this machine is better.

Streaming overlaps the CRIU dump with compression and upload, so its prediction is the GPU
checkpoint plus the slowest of the overlapped stages; staging adds them up.

A job of several processes (one rank per GPU) is checkpointed by the driver one process per
thread, all at once, and (with a CRIU that dumps processes in parallel) streamed one pages file
per process at once. So each of those stages is predicted from two measured rates: the rate of
one process (``gpu_checkpoint``, ``stream:<scheme>:L<level>``; the largest process sets the
time) and, once a run of several processes has measured it, the host's combined rate
(``...:host``; all processes together cannot go faster). Without a host rate the prediction is
the single-process rate applied to every byte: serial, as it was before the host measured more.

Where spotguard copies the GPU memory the driver staged beside CRIU (``gpu_pages``, a patched
CRIU), CRIU's rates apply to the CPU memory only and the copy has its own measured rate, until
a streamed run measured the whole stream on this machine.

When nothing fits, the planner says so at once and picks the configured fallback: the fastest
codec level (try anyway, best effort) or keep the newest periodic image (and tell the
controller).

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

from spotguard import safefs
from spotguard.config import Settings
from spotguard.errors import ConfigError
from spotguard.sizing import (
    THP_MODES,
    Estimate,
    ThpStatus,
    estimate,
    gpu_bytes_by_pid,
    gpu_bytes_of,
    set_thp,
    thp_status,
    tree_rss,
)
from spotguard.statedir import StateDir

__all__ = [
    "THP_MODES",
    "Estimate",
    "Plan",
    "Planner",
    "PlannerSettings",
    "ThpStatus",
    "estimate",
    "gpu_bytes_by_pid",
    "gpu_bytes_of",
    "set_thp",
    "thp_status",
    "tree_rss",
]

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
    # GPU memory copied beside CRIU (``gpu_pages``): 4.5-8.5 GB/s for 41 GB on H200 VMs
    "gpu_pages": 3.0 * GB,
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
    parallel: bool = False  # CRIU streams the processes' memory at once (one file each)
    beside: bool = False  # the GPU memory is copied beside CRIU (``gpu_pages``), not by it

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
            path = StateDir(state_dir).throughput
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
        body = {
            "throughput": self.throughput,
            "ratio": self.ratio,
            "runs": self.runs,
            "updated": time.time(),
            "thp": thp_status().enabled,
        }
        safefs.write_atomic(self.path, json.dumps(body, indent=2, sort_keys=True).encode())

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

    def _spread(self, key: str, rate: float, largest: int, total: int, processes: int) -> float:
        """Seconds for a stage that runs one process per thread: the largest process at one
        process's ``rate``, bounded below by every byte at the host's combined rate
        (``<key>:host``) once a run of several processes measured it; serial until then."""
        if processes <= 1 or largest >= total:
            return total / rate
        host = self.throughput.get(f"{key}:host")
        if host is None:
            return total / rate
        return max(largest / rate, total / host)

    def predict(
        self,
        est: Estimate,
        *,
        mode: Literal["stream", "stage"],
        level: int,
        store_url: str,
        parallel: bool = False,
        beside: bool = False,
    ) -> tuple[dict[str, float], float]:
        """Predicted seconds per stage and in total for one option. ``parallel``: CRIU dumps
        the processes' memory at once (the stream then spreads like the GPU checkpoint).
        ``beside``: spotguard copies the GPU memory the driver staged itself (``gpu_pages``,
        at its own rate) and CRIU dumps only the CPU memory — until a streamed run on this
        machine measured the whole stream, whose rate then covers every byte."""
        scheme = _scheme(store_url)
        ratio = self.ratio.get(f"L{level}", DEFAULT_RATIO)
        gpu = (
            self._spread(
                "gpu_checkpoint",
                self.throughput["gpu_checkpoint"],
                est.largest_gpu_bytes,
                est.gpu_bytes,
                est.processes,
            )
            if est.gpu_bytes
            else 0.0
        )
        beside = beside and est.gpu_bytes > 0
        by_criu = est.cpu_bytes if beside else est.total
        # a staged image is pushed whole (its GPU parts compressed like the rest); a stream
        # stores the GPU memory copied beside CRIU raw
        packed = est.total if mode == "stage" else by_criu
        raw = est.gpu_bytes if beside and mode == "stream" else 0
        stages = {
            "gpu_checkpoint": gpu,
            "criu_dump": by_criu / self.throughput["criu_dump"],
            "compress": packed / self._compress(level),
            "upload": (packed / ratio + raw) / self._upload(scheme),
        }
        if beside:  # on its own threads while CRIU dumps the rest
            stages["gpu_pages"] = est.gpu_bytes / self.throughput["gpu_pages"]
        key = f"stream:{scheme}:L{level}"
        measured = self.throughput.get(key)
        if mode == "stream":
            # Overlapped: the pipeline runs at its slowest stage (or as measured before).
            if measured and parallel:
                pipe = self._spread(key, measured, est.largest_bytes, est.total, est.processes)
            elif measured:
                pipe = est.total / measured
            else:
                pipe = max(stages["criu_dump"], stages["compress"], stages["upload"],
                           stages.get("gpu_pages", 0.0))  # fmt: skip
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
        parallel: bool = False,
        beside: bool = False,
    ) -> Plan:
        """Choose how to freeze: the first level that fits the deadline, else the fallback.
        ``parallel``: the CRIU at hand dumps the job's processes at once.

        Logs the plan (one line, with every stage) before anything is frozen.
        """
        mode: Literal["stream", "stage"] = "stream" if stream else "stage"
        thp = thp_status(pid)
        scheme = _scheme(store_url)
        candidates: list[Plan] = []
        for level in self.settings.levels:
            stages, total = self.predict(
                est, mode=mode, level=level, store_url=store_url, parallel=parallel,
                beside=beside,
            )  # fmt: skip
            fits = deadline_s is None or total + self.settings.margin_s <= deadline_s
            candidates.append(
                Plan(mode, level, scheme, est, deadline_s, stages, total, fits, "", thp,
                     parallel=parallel, beside=beside and est.gpu_bytes > 0)
            )  # fmt: skip
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
                    fastest.total_s, False, "", thp, parallel=parallel, beside=fastest.beside,
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
                "processes": est.processes,
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

        ``seconds`` holds measured stage durations: ``gpu_checkpoint`` and ``gpu_pages``;
        ``criu_dump``, ``compress``, ``upload`` for staged runs, ``stream`` (CRIU start →
        image durable) for streamed runs, and ``total`` (freeze start → durable) for both.
        """
        plan.actual = dict(seconds)
        est = plan.estimate
        g = gpu_bytes if gpu_bytes is not None else est.gpu_bytes
        many = est.processes > 1
        if g and seconds.get("gpu_checkpoint"):
            s = seconds["gpu_checkpoint"]
            # one process's rate from the largest one (they run at once); the host's from all
            one = min(g, est.largest_gpu_bytes) if many else g
            self._fold("gpu_checkpoint", one / s)
            if many:
                self._fold("gpu_checkpoint:host", g / s)
        if g and plan.beside and seconds.get("gpu_pages"):
            self._fold("gpu_pages", g / seconds["gpu_pages"])  # all processes' at once
        if raw_bytes:
            if plan.mode == "stream" and seconds.get("stream"):
                key = f"stream:{plan.store_scheme}:L{plan.level}"
                s = seconds["stream"]
                if plan.parallel and many:
                    self._fold(key, min(raw_bytes, est.largest_bytes) / s)
                    self._fold(f"{key}:host", raw_bytes / s)
                else:
                    self._fold(key, raw_bytes / s)
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
