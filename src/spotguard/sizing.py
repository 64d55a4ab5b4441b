"""How big a job's image will be and how the host's memory is set up for it.

:func:`estimate` sizes the job (GPU memory from NVML, RSS from psutil, per process, so the
planner knows the ranks and the largest one); :func:`thp_status` reads the host's transparent
huge page mode and a job's huge-page use; :func:`set_thp` sets the mode (the agent, at start);
:func:`meminfo` reads the host's memory counters (the one reader of ``/proc/meminfo``).
The deadline planner (:mod:`spotguard.planner`) predicts from these.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")


def meminfo(path: Path = MEMINFO) -> dict[str, int]:
    """The host's memory counters in bytes (``MemTotal``, ``MemAvailable`` ...); empty when
    unreadable, so a caller sizing memory by them takes nothing."""
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024
    return out


@dataclass(frozen=True)
class Estimate:
    """How big the image will be: GPU memory the job holds and its CPU-side memory."""

    gpu_bytes: int = 0
    cpu_bytes: int = 0
    source: str = ""
    processes: int = 1  # processes holding memory (ranks); 1 when unknown
    largest_gpu: int | None = None  # GPU bytes of the process that holds the most
    largest: int | None = None  # GPU + CPU bytes of the largest process

    @property
    def total(self) -> int:
        return self.gpu_bytes + self.cpu_bytes

    @property
    def largest_gpu_bytes(self) -> int:
        """GPU bytes of the largest process (all of them where the split is unknown)."""
        return self.gpu_bytes if self.largest_gpu is None else self.largest_gpu

    @property
    def largest_bytes(self) -> int:
        """Bytes of the largest process's image part (the whole image where unknown)."""
        return self.total if self.largest is None else self.largest


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


#: what the agent may set the host's THP mode to; "keep" leaves it as the VM came
THP_MODES = ("always", "madvise", "never", "keep")


def set_thp(mode: str, *, sys_root: Path = Path("/")) -> ThpStatus:
    """Set the host's transparent huge page mode (``enabled``) to ``mode`` unless it is
    ``keep`` or already so; return the mode in effect. One log line says what changed.

    Why the agent sets ``always`` by default: the driver's checkpoint stages device memory in
    one fresh anonymous mapping of the job, which ``madvise`` mode faults and pins in 4 KiB
    pages; on the H100 machine a 40 GiB checkpoint took 24.3 s that way and 15.8 s with
    ``always``, and CRIU's restore page-in halves (docs/benchmarks.md, "Huge pages"). Marking
    the driver's mapping MADV_HUGEPAGE from inside the job did not get it huge pages there.
    ``defrag`` is left alone (``madvise``: no compaction stalls in ordinary faults)."""
    status = thp_status(sys_root=sys_root)
    if mode == "keep" or status.enabled is None or status.enabled == mode:
        return status
    path = sys_root / "sys/kernel/mm/transparent_hugepage/enabled"
    try:
        path.write_text(mode)
    except OSError as exc:
        log.warning(
            "transparent huge pages stay as the host has them (GPU checkpoints are slower)",
            extra={"thp": status.enabled, "error": str(exc)},
        )
        return status
    log.info(
        "set transparent huge pages for GPU checkpoints",
        extra={"thp": mode, "previous": status.enabled},
    )
    return thp_status(sys_root=sys_root)


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


def gpu_bytes_by_pid(pids: set[int]) -> dict[int, int]:
    """GPU memory each of the given processes holds, by NVML; empty where there is no NVML
    or GPU."""
    from spotguard import nvml

    held: dict[int, int] = {}
    for proc in nvml.processes() or ():
        if proc.pid in pids and proc.used:
            held[proc.pid] = held.get(proc.pid, 0) + proc.used
    return held


def gpu_bytes_of(pids: set[int]) -> int:
    """GPU memory the given processes hold, by NVML; 0 where there is no NVML or GPU."""
    return sum(gpu_bytes_by_pid(pids).values())


def _rss_by_pid(pids: set[int]) -> dict[int, int]:
    import psutil

    rss: dict[int, int] = {}
    for pid in pids:
        try:
            rss[pid] = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return rss


def estimate(pid: int) -> Estimate:
    """Estimate the image of the job rooted at ``pid``.

    The GPU side ends up in host memory at checkpoint time and CRIU dumps both, so the image
    is about GPU bytes + RSS (measured: 98.5% GPU memory for a PyTorch trainer).
    The largest process and the number of processes that hold memory go with it: the stages
    that run one process per thread finish when the largest one does.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        pids = {pid, *(c.pid for c in root.children(recursive=True))}
    except psutil.Error:
        pids = {pid}
    from spotguard.checkpoint.proctree import uses_device

    # NVML only for a job on a GPU (every CUDA process holds /dev/nvidiactl and its GPUs'
    # device files open): its bindings take ~70 ms to import, and this estimate runs before
    # every freeze `spotguard checkpoint` makes
    gpu = gpu_bytes_by_pid(pids) if any(uses_device(p, "/dev/nvidia") for p in pids) else {}
    rss = _rss_by_pid(pids)
    # a process counts as one of the job's "ranks" when it holds GPU memory or at least
    # 1/16 of the largest process's memory (launchers and idle helpers do not)
    per = {p: gpu.get(p, 0) + rss.get(p, 0) for p in pids}
    biggest = max(per.values(), default=0)
    ranks = [p for p, n in per.items() if gpu.get(p) or (biggest and n * 16 >= biggest)]
    total_gpu = sum(gpu.values())
    return Estimate(
        gpu_bytes=total_gpu,
        cpu_bytes=sum(rss.values()),
        source="nvml+psutil" if total_gpu else "psutil",
        processes=max(1, len(ranks)),
        largest_gpu=max(gpu.values(), default=0),
        largest=biggest,
    )
