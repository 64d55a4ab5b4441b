"""What a GPU job's communication libraries must be told so that the driver checkpoint API
can capture it — set by ``spotguard run``, checked before every freeze.

Two ways (setting ``[checkpoint] nccl``, ``spotguard run --nccl``):

* ``release`` (the default where spotguard's NCCL shim is installed): :func:`release_env`
  preloads the shim (``LD_PRELOAD``) and names the job's control directory; NCCL keeps its
  own transport choices, and the engine releases the communicators before every freeze and
  rebuilds them after (:mod:`.ncclctl`). Processes with the shim loaded are not judged here.
* ``restrict`` (or no shim installed): the transports the driver cannot capture are turned
  off, as below.

The driver checkpoint API (r580) cannot capture memory shared between processes or GPUs:
CUDA IPC / cuMem handles (NCCL's P2P transport), host memory one process maps for another
(NCCL's SHM transport, whose cuMem host path hangs a restore), NVLink multicast objects
(NVLS: ``cuCheckpointProcessCheckpoint`` hangs on one), and CRIU cannot dump RDMA verbs
(InfiniBand / RoCE / EFA). NVIDIA's own snapshot tooling captures multi-GPU jobs only with
P2P, SHM and NVLS off; NCCL then moves data through its socket transport (slower: see
docs/limits.md for the measured cost).

:data:`CHECKPOINTABLE` lists the settings; :func:`job_env` fills in those a job did not set
(an explicit choice of the user is kept, and then judged); :func:`env_problems` names each
setting of a process that cannot be checkpointed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from spotguard.errors import UndumpableError
from spotguard.groupwire import GROUP_ENV

from .ncclctl import ENV_CTL, shim_loaded
from .procfacts import comm, read_environ

#: setting → (value that keeps a job checkpointable, why)
CHECKPOINTABLE: dict[str, tuple[str, str]] = {
    "NCCL_P2P_DISABLE": ("1", "P2P shares GPU memory between processes by CUDA IPC"),
    "NCCL_SHM_DISABLE": ("1", "SHM maps host memory of one process into another"),
    "NCCL_CUMEM_HOST_ENABLE": ("0", "cuMem host memory hangs the driver's restore"),
    "NCCL_NVLS_ENABLE": ("0", "NVLink multicast objects hang the driver's checkpoint"),
    "NCCL_COLLNET_ENABLE": ("0", "CollNet uses in-network (RDMA) state"),
    "NCCL_IB_DISABLE": ("1", "RDMA (InfiniBand/RoCE) verbs cannot be dumped"),
    "NCCL_NET": ("Socket", "network plugins (EFA, IB) use RDMA, which cannot be dumped"),
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": ("1", "symmetric memory uses NVLink multicast"),
    "NVSHMEM_DISABLE_NVLS": ("1", "NVSHMEM uses NVLink multicast"),
}


#: set by ``spotguard run`` unless the job sets them, but not judged before a freeze: the
#: ranks of a job on one VM talk over loopback, so their connections restore on any VM (on
#: the VM's own address, the default, CRIU can restore them only where that address exists).
#: A job whose ranks span VMs (``--nccl-group``) is given neither: its ranks must reach the
#: other VMs, and its NCCL connections are gone at every freeze (the shim releases them).
PORTABLE: dict[str, str] = {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}


def _portable(env: dict[str, str]) -> None:
    if GROUP_ENV not in env:
        for key, value in PORTABLE.items():
            env.setdefault(key, value)


def job_env(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus every checkpointable and portable setting it does not already have."""
    env = dict(base)
    for key, (value, _why) in CHECKPOINTABLE.items():
        env.setdefault(key, value)
    _portable(env)
    return env


def release_env(base: Mapping[str, str], shim: Path, control: Path) -> dict[str, str]:
    """``base`` with spotguard's NCCL shim preloaded (first in ``LD_PRELOAD``), its control
    directory named, and the portable settings it does not have; NCCL's transports are left
    to NCCL (and to whatever ``base`` sets, e.g. the machine's own ``NCCL_NVLS_ENABLE``)."""
    env = dict(base)
    preload = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p != str(shim)]
    env["LD_PRELOAD"] = " ".join([str(shim), *preload])
    env[ENV_CTL] = str(control)
    _portable(env)
    return env


@dataclass(frozen=True)
class EnvProblem:
    """A setting of a process that keeps it from being checkpointed."""

    key: str
    value: str | None  # None: not set (NCCL's default is the uncheckpointable one)
    wanted: str
    why: str

    def __str__(self) -> str:
        have = "unset" if self.value is None else f"{self.key}={self.value}"
        return f"{have} (set {self.key}={self.wanted}: {self.why})"


def _distributed(env: Mapping[str, str]) -> bool:
    try:
        return int(env.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def env_problems(env: Mapping[str, str]) -> list[EnvProblem]:
    """Each setting in ``env`` that cannot be checkpointed. A value set otherwise is always
    one; an unset one only in a distributed process (``WORLD_SIZE`` > 1), where NCCL's
    defaults would pick the shared-memory transports."""
    out = []
    for key, (wanted, why) in CHECKPOINTABLE.items():
        value = env.get(key)
        if value is None and not _distributed(env):
            continue
        if value is None or value.strip() != wanted:
            out.append(EnvProblem(key, value, wanted, why))
    return out


def uses_nccl(pid: int) -> bool:
    """True if the process has NCCL loaded."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text(errors="replace")
    except OSError:
        return False
    return "libnccl" in maps


def refuse_uncheckpointable(job: str, gpu_pids: Sequence[int]) -> None:
    """The freeze rule: raise :class:`UndumpableError` (not retryable) naming the pid, the
    process and each setting when a GPU process with NCCL loaded cannot be checkpointed.
    A process with spotguard's NCCL shim loaded is not judged: its communicators are released
    before the freeze instead."""
    found = []
    for pid in gpu_pids:
        if not uses_nccl(pid) or shim_loaded(pid):
            continue
        problems = env_problems(read_environ(pid))
        if problems:
            found.append(f"pid {pid} ({comm(pid)}): " + "; ".join(str(p) for p in problems))
    if found:
        found.append("restart it with these settings ('spotguard run' sets them)")
        raise UndumpableError(job, found)
