"""The layout of a node's state directory (``[checkpoint] state_dir``, default
``/var/lib/spotguard``), named in one place.

Why an object of its own: the agent, ``spotguard run``, park, the checkpoint operations and the
CLI each keep something under the same directory, and an operator (or a recovery after a
crash) must find it where another part left it. Every path below is built here; the modules
that own what a path holds decide how to write it (``safefs``)::

    {state_dir}/
      jobs/<job>/            a job started by `spotguard run` (job.json, output, operation.json)
      staging/               images staged on disk before their upload
      kept/                  exit images not durable yet (spotguard.operations.kept)
      parked/                park records, <job>.json and <job>.lock (spotguard.park.record)
      parked/images/<job>/   images parked on this node's disk
      containers/            work directories of container checkpoints and restores
      containers/parked/     records of parked containers
      containers/jobs/       which container an agent's job name stands for (container.guard)
      containers/restores/   a container restore's intent, then outcome (container.restore)
      containers/held-specs/ containerd spec blobs a checkpoint moved aside (container.ctrspec)
      containers/busy/       a container checkpoint or restore running (spotguard.warm)
      keys/host-image.key    the host's key that seals local images (checkpoint.seal)
      throughput.json        the deadline planner's measurements
      agent/                 the agent daemon's own:
        agent.lock           one agent per state dir (agent.startup)
        api.token            the local API's token when none is configured
        jobs/<job>.json      the ledger: what the agent last did to each job
        outbox/              reports not yet delivered to the controller
        assignments/         boot-restore progress per assignment (agent.restore)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["HOST_KEY", "StateDir"]

#: the host's image-sealing key, under ``keys/``
HOST_KEY = "host-image.key"


@dataclass(frozen=True)
class StateDir:
    """The paths under one state directory (nothing is created or read here)."""

    root: Path

    # --- jobs and images ------------------------------------------------------------------

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    def job(self, name: str) -> Path:
        """The directory of job ``name`` (``spotguard run``'s)."""
        return self.jobs / name

    @property
    def staging(self) -> Path:
        return self.root / "staging"

    @property
    def kept(self) -> Path:
        return self.root / "kept"

    @property
    def parked(self) -> Path:
        return self.root / "parked"

    @property
    def parked_images(self) -> Path:
        return self.parked / "images"

    @property
    def containers(self) -> Path:
        return self.root / "containers"

    @property
    def parked_containers(self) -> Path:
        return self.containers / "parked"

    @property
    def container_jobs(self) -> Path:
        return self.containers / "jobs"

    @property
    def container_restores(self) -> Path:
        return self.containers / "restores"

    @property
    def container_busy(self) -> Path:
        return self.containers / "busy"

    @property
    def held_specs(self) -> Path:
        return self.containers / "held-specs"

    @property
    def host_key(self) -> Path:
        return self.root / "keys" / HOST_KEY

    @property
    def throughput(self) -> Path:
        return self.root / "throughput.json"

    # --- the agent daemon -----------------------------------------------------------------

    @property
    def agent(self) -> Path:
        return self.root / "agent"

    @property
    def agent_lock(self) -> Path:
        return self.agent / "agent.lock"

    @property
    def api_token(self) -> Path:
        return self.agent / "api.token"

    @property
    def ledger(self) -> Path:
        return self.agent / "jobs"

    @property
    def outbox(self) -> Path:
        return self.agent / "outbox"

    @property
    def assignments(self) -> Path:
        return self.agent / "assignments"
