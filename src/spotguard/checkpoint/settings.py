"""Checkpoint settings: one definition each → ``[checkpoint]`` key, ``SPOTGUARD_*`` env, ``--flag``.

``state_dir`` is shared by every part that keeps local state (jobs, staging, the agent's
files); it is defined here, once, because jobs live under it.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from spotguard.config import Settings
from spotguard.statedir import StateDir

DEFAULT_STATE_DIR = Path("/var/lib/spotguard")


class CheckpointSettings(Settings):
    """``[checkpoint]``: where jobs live, which CRIU to run and how long each step may take."""

    section: ClassVar[str] = "checkpoint"

    state_dir: Path = Field(
        default=DEFAULT_STATE_DIR, description="Directory for jobs, staging images and agent state"
    )
    criu: str | None = Field(
        default=None,
        description=(
            "CRIU executable (default: criu on PATH if >= 4.2.1, else /opt/spotguard/criu/bin/criu)"
        ),
    )
    criu_timeout: float = Field(
        default=600.0, gt=0, description="Seconds one criu dump/restore may take"
    )
    criu_log_level: int = Field(
        default=2,
        ge=0,
        le=4,
        description=(
            "CRIU's log verbosity (criu -vN); the log is kept beside the image's files "
            "(criu-dump.log, criu-restore.log): 4 shows where a dump's or restore's time goes"
        ),
    )
    gpu_timeout: float = Field(
        default=300.0, gt=0, description="Seconds one GPU checkpoint/restore call may take"
    )
    ghost_limit: int = Field(
        default=4 << 30,
        ge=0,
        description=(
            "Largest deleted file a job still holds open or mapped that a checkpoint carries "
            "(criu --ghost-limit; NCCL maps a deleted /dev/shm file of ~34 MB; CRIU's own "
            "default is 1 MiB)"
        ),
    )
    gpu_lock_timeout: float = Field(
        default=10.0, gt=0, description="Seconds to wait for submitted GPU work when locking"
    )
    tcp_established: bool = Field(
        default=False,
        description=(
            "Always dump with criu --tcp-established (default: only when the job holds a "
            "connected TCP socket, detected before each freeze)"
        ),
    )
    network_lock: Literal["auto", "nftables", "iptables", "skip"] = Field(
        default="auto",
        description=(
            "How CRIU blocks the job's TCP connections while it dumps them (auto: nftables, "
            "else iptables, else skip when every connection stays inside the job)"
        ),
    )
    manage_cgroups: str | None = Field(
        default=None,
        description="criu --manage-cgroups mode (soft, full, strict, ignore; default: off)",
    )
    pid_wait: float = Field(
        default=120.0,
        ge=0,
        description="Seconds restore waits for PIDs of a just-killed job without own PID namespace",
    )
    restore_gpus: str | None = Field(
        default=None,
        description=(
            "Host GPUs (indices or UUIDs, comma-separated, in the image's GPU order) that an "
            "image's GPUs are restored onto when this host has more (default: the image's own "
            "UUIDs where present, else the first ones)"
        ),
    )
    nccl: Literal["release", "restrict"] = Field(
        default="release",
        description=(
            "NCCL jobs started by 'spotguard run': release (NCCL keeps its fast transports; "
            "spotguard's NCCL shim releases the communicators before each freeze and rebuilds "
            "them after; needs scripts/install-nccl-shim, else restrict) or restrict (NCCL's "
            "P2P, SHM, NVLS and RDMA transports off, as the driver needs without the shim)"
        ),
    )
    nccl_shim: Path = Field(
        default=Path("/opt/spotguard/nccl-shim/lib/libspotguard_nccl.so"),
        description="spotguard's NCCL shim, as scripts/install-nccl-shim installs it",
    )
    nccl_group_join_s: float = Field(
        default=20.0,
        gt=0,
        description=(
            "NCCL groups (spotguard run --nccl-group): seconds a freeze waits, beyond the GPU "
            "lock timeout, for the other members' agents to join it"
        ),
    )
    nccl_group_wait_s: float = Field(
        default=600.0,
        gt=0,
        description=(
            "NCCL groups: seconds a restored member waits for the others to be restored "
            "before their communicators are rebuilt"
        ),
    )
    shm_dir: Path = Field(
        default=Path("/dev/shm/spotguard"), description="Staging directory in memory (tmpfs)"
    )
    memory_margin: int = Field(
        default=512 * 1024 * 1024,
        ge=0,
        description="Bytes of RAM to leave free when staging an image in memory",
    )
    stream: Literal["auto", "on", "off"] = Field(
        default="auto",
        description=(
            "Checkpoints to a store URL: stream the dump straight into the store (auto: when "
            "CRIU supports --stream, else stage; on: always; off: stage in tmpfs/disk, then push)"
        ),
    )
    gpu_pages: Literal["spotguard", "criu"] = Field(
        default="spotguard",
        description=(
            "Who moves the GPU memory the driver staged in host memory: spotguard, several "
            "threads at once beside CRIU (needs spotguard's CRIU; else CRIU), or CRIU, one "
            "pipe per process"
        ),
    )
    cpu_pages: Literal["spotguard", "criu"] = Field(
        default="spotguard",
        description=(
            "Who moves the job's own large private memory (mappings of at least "
            "cpu_pages_min_mib that no other process shares): spotguard, several threads at "
            "once beside CRIU from the moment the tree is frozen (needs spotguard's CRIU; "
            "else CRIU), or CRIU, one pipe per process"
        ),
    )
    cpu_page_workers: int = Field(
        default=0,
        ge=0,
        le=256,
        description=(
            "Parts of the job's own memory (cpu_pages) copied at once, freezing and restoring "
            "(0: one per core, at most 16: on a 16-core H200 VM 16 threads paused 8 ranks of 4 "
            "GiB in 1.15 s against 1.53 s with 8, docs/benchmarks.md)"
        ),
    )
    cpu_pages_min_mib: int = Field(
        default=256,
        ge=1,
        description="The smallest private mapping spotguard moves itself (cpu_pages)",
    )
    gpu_page_workers: int = Field(
        default=0,
        ge=0,
        le=256,
        description=(
            "Parts of the GPU memory staged in host memory copied at once (0: half the "
            "cores, at most 8: more threads made the copies slower on the GPU machines "
            "measured, docs/benchmarks.md)"
        ),
    )
    restore_overlap: bool = Field(
        default=True,
        description=(
            "Restore: let the driver's restore start while the staged GPU memory is still "
            "being written back (userfaultfd in the restored process, pages placed with "
            "UFFDIO_MOVE in address order; Linux 6.8+, x86-64, a root job); falls back to "
            "writing it all back first where that cannot be set up. 40 GiB restore on an "
            "H200: 11.9-12.3 s against 16.0 s (docs/benchmarks.md)"
        ),
    )
    restore_overlap_min_mib: int = Field(
        default=16384,
        ge=0,
        description=(
            "Place the staged GPU memory under the driver's restore only for restores of at "
            "least this many MiB of it: below, setting it up costs more than the overlap "
            "saves (a 2.7 GB server: 1.4 s placed against 0.8 s written back first)"
        ),
    )
    prefault_staging: bool = Field(
        default=True,
        description=(
            "While the driver checkpoints GPU memory into host memory, fault in the pages it "
            "maps with gpu_page_workers threads beside it (needs transparent huge pages "
            "'always'; the huge zero page is off during the checkpoint): a 40 GiB checkpoint "
            "took 8.9-9.5 s instead of 15.7-25.3 s on an H200 (docs/benchmarks.md)"
        ),
    )
    resume_buffer_mb: int = Field(
        default=-1,
        ge=-1,
        description=(
            "A leave-running checkpoint to a store copies the job's image into this much host "
            "memory and lets the job go on, then streams it (the job is frozen for the copy, "
            "not for the upload); -1: what the host can spare (available memory less the GPU "
            "memory the driver stages and a reserve), 0: the job waits for the store"
        ),
    )
    pack_after_resume: bool = Field(
        default=True,
        description=(
            "A leave-running checkpoint keeps the part of its image held in host memory raw "
            "while the job is frozen and hashes, compresses and stores it once the job runs "
            "again: the cores copy the image out instead, and the job's pause is shorter; "
            "false: the chunks are processed as they come, also while the job is frozen"
        ),
    )
    prefault_hold: bool = Field(
        default=True,
        description=(
            "A leave-running checkpoint to a store faults in the host memory it keeps the "
            "job's image in (about the job's resident memory and its GPU memory in use) "
            "before the freeze, while the "
            "job still runs: the frozen job then does not wait for the kernel to zero fresh "
            "pages; costs that memory (within the hold) and the time to fault it in, before "
            "the freeze; false: pieces are made as the image flows, while the job is frozen"
        ),
    )
    max_file_bytes: int = Field(
        default=1024 * 1024 * 1024,
        ge=0,
        description="Most bytes of the job's open output files to carry inside an image",
    )

    @property
    def layout(self) -> StateDir:
        """The paths under ``state_dir`` (:mod:`spotguard.statedir`)."""
        return StateDir(self.state_dir)

    @property
    def jobs_dir(self) -> Path:
        return self.layout.jobs

    @property
    def disk_staging_dir(self) -> Path:
        return self.layout.staging
