"""Shared by the docker tests: one "VM" is its own dockerd (scripts/install-docker's, its own
data root, exec root, pid file and socket under a short temp dir, ``--experimental`` for
``docker checkpoint``, no bridge and no iptables, a runtime entry for spotguard's runc
wrapper) and its own spotguard state dir. A docker on the host, if any, is never used."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from spotguard.container.docker import Docker
from spotguard.container.settings import CONTAINERD_PREFIX, DOCKER_PREFIX

IMAGE = "localhost/sg-counter:1"
RUNTIME = "spotguard"


@dataclass
class DockerVm:
    """One "VM": its own dockerd and spotguard state dir."""

    base: Path
    docker: Docker
    state_dir: Path
    daemon: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, base: Path, criu: str) -> DockerVm:
        base.mkdir(parents=True)
        docker = Docker(
            binary=str(DOCKER_PREFIX / "bin" / "docker"), host=f"unix://{base}/sock",
            runc=str(CONTAINERD_PREFIX / "bin" / "runc"), criu=criu, runtime_name=RUNTIME,
            timeout=120,
        )  # fmt: skip
        docker.prepare()
        path = f"{DOCKER_PREFIX / 'bin'}:{CONTAINERD_PREFIX / 'bin'}:{os.environ['PATH']}"
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
                env={**os.environ, "PATH": path}, start_new_session=True,
            )  # fmt: skip
        vm = cls(base, docker, base / "state", daemon)
        end = time.monotonic() + 30
        while vm.cmd("version", "--format", "{{.Server.Version}}", check=False).strip() == "":
            assert daemon.poll() is None, (base / "dockerd.log").read_text()[-2000:]
            assert time.monotonic() < end, "dockerd did not come up"
            time.sleep(0.05)
        return vm

    def cli_env(self) -> dict[str, str]:
        """The environment that points spotguard's CLI at this VM."""
        env = dict(os.environ)
        env.update(
            SPOTGUARD_STATE_DIR=str(self.state_dir),
            SPOTGUARD_CONTAINER_DOCKER=self.docker.binary,
            SPOTGUARD_CONTAINER_DOCKER_HOST=self.docker.host,
            SPOTGUARD_CONTAINER_DOCKER_RUNTIME=RUNTIME,
            SPOTGUARD_CONTAINER_RUNC=self.docker.runc,
            SPOTGUARD_CRIU=self.docker.criu,
        )
        return env

    def cmd(self, *args: str, check: bool = True, stdin: bytes | None = None) -> str:
        out = subprocess.run(
            self.docker.argv(*args), input=stdin, capture_output=True, timeout=120, check=False
        )
        if check and out.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)}: {out.stderr.decode()[-2000:]}")
        return out.stdout.decode(errors="replace")

    def stop(self) -> None:
        """Every container removed, then dockerd (and the containerd it runs) stopped and
        what it mounted undone."""
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
        for d in ("exec", "data"):
            subprocess.run(["umount", "-R", "-l", str(self.base / d)], capture_output=True)
        mounts = Path("/proc/self/mounts").read_text().split("\n")
        for line in mounts:
            fields = line.split()
            if len(fields) > 1 and fields[1].startswith(f"{self.base}/"):
                subprocess.run(["umount", "-l", fields[1]], capture_output=True)
