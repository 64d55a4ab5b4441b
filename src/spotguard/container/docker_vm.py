"""A dockerd of spotguard's own, as a "VM" of ``spotguard demo --container --runtime docker``
and of the tests: its own data root, exec root, pid file and socket under a directory it is
given, ``--experimental`` (``docker checkpoint``), no bridge and no iptables, and a runtime
entry for spotguard's runc wrapper; dockerd runs its own containerd from
scripts/install-containerd's prefix. A docker on the host, if any, is never used.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from spotguard.container.docker import Docker
from spotguard.container.settings import CONTAINERD_PREFIX, DOCKER_PREFIX
from spotguard.errors import ContainerError

#: the runtime entry the VM's dockerd has for spotguard's runc wrapper
RUNTIME = "spotguard"
#: how long a fresh daemon may take to answer
START_S = 30.0


@dataclass
class DockerVm:
    """One "VM": its own dockerd (under ``base``) and spotguard state dir."""

    base: Path
    docker: Docker
    state_dir: Path
    daemon: subprocess.Popen[bytes] | None = None

    @property
    def runtime_dir(self) -> Path:
        """The ``$TMPDIR`` of dockerd and of the containerd it runs: where containerd
        unpacks a checkpoint it restores (its own, not the host's ``/tmp``)."""
        return self.base / "tmp"

    @classmethod
    def start(cls, base: Path, criu: str) -> Self:
        """Start dockerd (``base`` is made; keep it short: socket paths); ContainerError
        when it does not answer within :data:`START_S`."""
        base.mkdir(parents=True)
        docker = Docker(
            binary=str(DOCKER_PREFIX / "bin" / "docker"), host=f"unix://{base}/sock",
            runc=str(CONTAINERD_PREFIX / "bin" / "runc"), criu=criu, runtime_name=RUNTIME,
            timeout=120,
        )  # fmt: skip
        docker.prepare()
        (base / "tmp").mkdir(mode=0o700)
        path = f"{DOCKER_PREFIX / 'bin'}:{CONTAINERD_PREFIX / 'bin'}:{os.environ.get('PATH', '')}"
        with open(base / "dockerd.log", "wb") as log:
            daemon = subprocess.Popen(
                [
                    str(DOCKER_PREFIX / "bin" / "dockerd"), "--experimental",
                    "--iptables=false", "--ip6tables=false", "--bridge=none",
                    "--data-root", str(base / "data"), "--exec-root", str(base / "exec"),
                    "--pidfile", str(base / "pid"), "-H", docker.host,
                    "--storage-driver", "overlay2",
                    "--add-runtime", f"{RUNTIME}={docker.runtime}",
                ],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=base,
                env={**os.environ, "PATH": path, "TMPDIR": str(base / "tmp")},
                start_new_session=True,
            )  # fmt: skip
        vm = cls(base, docker, base / "spotguard-state", daemon)
        end = time.monotonic() + START_S
        while not vm.cmd("version", "--format", "{{.Server.Version}}", check=False).strip():
            if daemon.poll() is not None or time.monotonic() > end:
                vm.stop()
                said = (base / "dockerd.log").read_text(errors="replace")[-500:]
                raise ContainerError(f"dockerd in {base} did not come up: {said}")
            time.sleep(0.05)
        return vm

    def env(self) -> dict[str, str]:
        """What points a spotguard command at this VM's dockerd and state dir."""
        return {
            "SPOTGUARD_STATE_DIR": str(self.state_dir),
            "SPOTGUARD_CONTAINER_DOCKER": self.docker.binary,
            "SPOTGUARD_CONTAINER_DOCKER_HOST": self.docker.host,
            "SPOTGUARD_CONTAINER_DOCKER_RUNTIME": RUNTIME,
            "SPOTGUARD_CONTAINER_RUNC": self.docker.runc,
            "SPOTGUARD_CRIU": self.docker.criu,
        }

    def cmd(self, *args: str, check: bool = True, stdin: bytes | None = None) -> str:
        """``docker ARGS``; its stdout (``check``: ContainerError on failure)."""
        out = subprocess.run(
            self.docker.argv(*args), input=stdin, capture_output=True, timeout=120, check=False
        )
        if check and out.returncode != 0:
            said = out.stderr.decode(errors="replace").strip()[-500:]
            raise ContainerError(f"docker {' '.join(args)}: {said}")
        return out.stdout.decode(errors="replace")

    def stop(self) -> None:
        """Every container removed, then dockerd (and the containerd it runs) stopped and
        what it mounted under ``base`` undone."""
        daemon, self.daemon = self.daemon, None
        if daemon is None:
            return
        if daemon.poll() is None:
            ids = self.cmd("ps", "-aq", check=False).split()
            if ids:
                self.cmd("rm", "--force", *ids, check=False)
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        for line in reversed(Path("/proc/self/mounts").read_text().splitlines()):
            fields = line.split()
            if len(fields) > 1 and fields[1].startswith(f"{self.base}/"):
                subprocess.run(["umount", "-l", fields[1]], capture_output=True)
