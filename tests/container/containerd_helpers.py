"""Shared by the containerd tests: one "VM" is its own containerd daemon (its own root, state
and socket under a short temp dir, the CRI plugin off) and its own spotguard state dir; a
containerd on the host, if any, is never used. The job's image is an OCI layout built offline
from a rootfs of the host's ``dash`` and ``sleep`` (no registry), imported into each VM: the
same manifest digest on both, as a registry pull would give.
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

from spotguard.container.containerd import Containerd
from spotguard.container.settings import CONTAINERD_PREFIX

IMAGE = "localhost/sg-counter:1"
NS = "sg"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def image_layout(rootfs: Path, dest: Path, name: str = IMAGE) -> Path:
    """An OCI image layout (tar) of one uncompressed layer, ``rootfs``, named ``name``."""
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
class CtrVm:
    """One "VM": its own containerd daemon and spotguard state dir."""

    base: Path
    ctrd: Containerd
    state_dir: Path
    daemon: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, base: Path, criu: str) -> CtrVm:
        base.mkdir(parents=True)
        conf = base / "config.toml"
        conf.write_text(
            f'version = 2\nroot = "{base}/root"\nstate = "{base}/state"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{base}/sock"\n[ttrpc]\n  address = "{base}/sock.ttrpc"\n'
        )
        ctrd = Containerd(
            ctr=str(CONTAINERD_PREFIX / "bin" / "ctr"),
            address=base / "sock",
            runc=str(CONTAINERD_PREFIX / "bin" / "runc"),
            criu=criu,
            timeout=120,
        )
        env = {**os.environ, "PATH": f"{CONTAINERD_PREFIX / 'bin'}:{os.environ['PATH']}"}
        with open(base / "containerd.log", "wb") as log:
            daemon = subprocess.Popen(
                [str(CONTAINERD_PREFIX / "bin" / "containerd"), "--config", str(conf)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd=base,
            )  # fmt: skip
        vm = cls(base, ctrd, base / "state-sg", daemon)
        end = time.monotonic() + 20
        while vm.ctr("version", check=False, ns=NS).count("Version") < 2:
            assert daemon.poll() is None, (base / "containerd.log").read_text()[-2000:]
            assert time.monotonic() < end, "containerd did not come up"
            time.sleep(0.05)
        return vm

    def cli_env(self) -> dict[str, str]:
        """The environment that points spotguard's CLI at this VM."""
        env = dict(os.environ)
        env.update(
            SPOTGUARD_STATE_DIR=str(self.state_dir),
            SPOTGUARD_CONTAINER_CTR=self.ctrd.ctr,
            SPOTGUARD_CONTAINER_CONTAINERD_ADDRESS=str(self.ctrd.address),
            SPOTGUARD_CONTAINER_RUNC=self.ctrd.runc,
            SPOTGUARD_CRIU=self.ctrd.criu,
        )
        return env

    def ctr(self, *args: str, check: bool = True, ns: str = NS) -> str:
        out = subprocess.run(
            self.ctrd.argv(ns, *args), capture_output=True, text=True, timeout=120, check=False
        )
        if check and out.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)}: {out.stderr[-2000:]}")
        return out.stdout

    def stop(self) -> None:
        """Every task killed and deleted (their shims end), every container deleted, then
        the daemon stopped."""
        if self.daemon is None:
            return
        if self.daemon.poll() is None:
            for line in self.ctr("tasks", "ls", check=False).splitlines()[1:]:
                cid = line.split()[0]
                self.ctr("tasks", "kill", "-s", "KILL", cid, check=False)
            for cid in self.ctr("containers", "ls", "-q", check=False).split():
                for _ in range(50):
                    self.ctr("tasks", "delete", "--force", cid, check=False)
                    if cid not in self.ctr("tasks", "ls", check=False):
                        break
                    time.sleep(0.1)
                self.ctr("containers", "delete", cid, check=False)
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(10)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()
        self.daemon = None
        subprocess.run(["umount", "-R", "-l", str(self.base / "state")], capture_output=True)
