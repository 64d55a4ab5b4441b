"""A containerd daemon of spotguard's own, as a "VM" of ``spotguard demo --container
--runtime containerd`` and of the tests: its own root, state and socket under a directory it
is given, the CRI plugin off, the prefix's shim and runc first on its ``PATH``. A containerd on
the host, if any, is never used. :func:`image_layout` builds the job's image offline (no
registry) as an OCI layout that ``ctr images import`` takes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from spotguard.container.containerd import Containerd
from spotguard.container.runtime import criu_errors
from spotguard.container.settings import CONTAINERD_PREFIX
from spotguard.errors import ContainerError

#: how long a fresh daemon may take to answer
START_S = 20.0


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def image_layout(rootfs: Path, dest: Path, name: str) -> Path:
    """An OCI image layout (tar) at ``dest`` of one uncompressed layer, the tarball
    ``rootfs``, named ``name``: the same manifest digest wherever it is imported."""
    layer = rootfs.read_bytes()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Cmd": ["/bin/sh"], "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
    }).encode()  # fmt: skip
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": _digest(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": _digest(layer), "size": len(layer)}],
    }).encode()  # fmt: skip
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": _digest(manifest),
        "size": len(manifest), "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {"org.opencontainers.image.ref.name": name},
    }]}).encode()  # fmt: skip
    with tarfile.open(dest, "w") as tar:
        members = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": index}
        members.update({f"blobs/sha256/{_digest(b)[7:]}": b for b in (layer, config, manifest)})
        for member, data in members.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return dest


@dataclass
class ContainerdVm:
    """One "VM": its own containerd daemon (under ``base``) and spotguard state dir."""

    base: Path
    ctrd: Containerd
    state_dir: Path
    daemon: subprocess.Popen[bytes] | None = None

    @property
    def runtime_dir(self) -> Path:
        """The daemon's ``$XDG_RUNTIME_DIR``: where containerd unpacks a checkpoint it
        restores (its own, not the host's ``/tmp``)."""
        return self.base / "xdg"

    @classmethod
    def start(cls, base: Path, criu: str, *, prefix: Path = CONTAINERD_PREFIX) -> Self:
        """Start the daemon (``base`` is made; keep it short: socket paths); ContainerError
        when it does not answer within :data:`START_S`."""
        base.mkdir(parents=True)
        conf = base / "config.toml"
        conf.write_text(
            f'version = 2\nroot = "{base}/root"\nstate = "{base}/state"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{base}/sock"\n[ttrpc]\n  address = "{base}/sock.ttrpc"\n'
        )
        ctrd = Containerd(
            ctr=str(prefix / "bin" / "ctr"), address=base / "sock",
            runc=str(prefix / "bin" / "runc"), criu=criu, timeout=120,
        )  # fmt: skip
        env = {**os.environ, "PATH": f"{prefix / 'bin'}:{os.environ.get('PATH', '/usr/bin')}"}
        env["XDG_RUNTIME_DIR"] = str(base / "xdg")
        (base / "xdg").mkdir(mode=0o700)
        with open(base / "containerd.log", "wb") as log:
            daemon = subprocess.Popen(
                [str(prefix / "bin" / "containerd"), "--config", str(conf)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd=base,
                start_new_session=True,
            )  # fmt: skip
        vm = cls(base, ctrd, base / "spotguard-state", daemon)
        end = time.monotonic() + START_S
        while vm.ctr("version", check=False).count("Version") < 2:
            if daemon.poll() is not None or time.monotonic() > end:
                vm.stop()
                said = (base / "containerd.log").read_text(errors="replace")[-500:]
                raise ContainerError(f"containerd in {base} did not come up: {said}")
            time.sleep(0.05)
        return vm

    def env(self) -> dict[str, str]:
        """What points a spotguard command at this VM's containerd and state dir."""
        return {
            "SPOTGUARD_STATE_DIR": str(self.state_dir),
            "SPOTGUARD_CONTAINER_CTR": self.ctrd.ctr,
            "SPOTGUARD_CONTAINER_CONTAINERD_ADDRESS": str(self.ctrd.address),
            "SPOTGUARD_CONTAINER_RUNC": self.ctrd.runc,
            "SPOTGUARD_CRIU": self.ctrd.criu,
        }

    def ctr(self, *args: str, check: bool = True, ns: str = "default") -> str:
        """``ctr ARGS`` in namespace ``ns``; its stdout (``check``: ContainerError on failure)."""
        out = subprocess.run(
            self.ctrd.argv(ns, *args), capture_output=True, text=True, timeout=120, check=False
        )
        if check and out.returncode != 0:
            criu = criu_errors(out.stderr)  # what CRIU refused, before runc removes its log
            said = out.stderr.strip()[-500:] + (f" (CRIU's log: {criu[1]})" if criu else "")
            raise ContainerError(f"ctr {' '.join(args)}: {said}")
        return out.stdout

    def stop(self) -> None:
        """Every task of every namespace killed and deleted (their shims end), every
        container deleted, then the daemon stopped and the task mounts left undone."""
        daemon, self.daemon = self.daemon, None
        if daemon is None:
            return
        if daemon.poll() is None:
            for ns in self.ctr("namespaces", "ls", "-q", check=False).split():
                self._clear(ns)
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        subprocess.run(["umount", "-R", "-l", str(self.base / "state")], capture_output=True)

    def _clear(self, ns: str) -> None:
        for line in self.ctr("tasks", "ls", check=False, ns=ns).splitlines()[1:]:
            self.ctr("tasks", "kill", "-s", "KILL", line.split()[0], check=False, ns=ns)
        for cid in self.ctr("containers", "ls", "-q", check=False, ns=ns).split():
            for _ in range(50):
                self.ctr("tasks", "delete", "--force", cid, check=False, ns=ns)
                if cid not in self.ctr("tasks", "ls", check=False, ns=ns).split():
                    break
                time.sleep(0.1)
            self.ctr("containers", "delete", cid, check=False, ns=ns)
