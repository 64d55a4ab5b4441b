"""A containerd container restored on a host that lacks its image: the image is pulled from a
real registry (the distribution's ``docker-registry``, on 127.0.0.1) by the exact digest the
container ran, through the registry configuration ``[container] containerd_hosts_dir`` names
(``hosts.toml``, as containerd's ``/etc/containerd/certs.d``), with real containerd, runc and
CRIU; the output continues byte-identically. Without that configuration the pull fails and
the restore is refused, one line, before anything is created."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from containerd_helpers import IMAGE, NS, CtrVm
from test_containerd import EXPECTED, JOB, LINES, _ok, _refused

from sgtest import free_port, installed, wait_lines

REGISTRY = Path("/opt/spotguard/registry/bin/registry")


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A registry of our own (plain HTTP on 127.0.0.1) known as ``registry.test:PORT`` only
    through a hosts dir (containerd lets loopback names fall back to plain HTTP by itself):
    (that name, the hosts dir)."""
    installed(REGISTRY, "install-registry")
    port = free_port()
    addr = f"127.0.0.1:{port}"
    conf = tmp_path / "registry.yml"
    conf.write_text(
        "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {tmp_path / 'blobs'}\n"
        f"http:\n  addr: {addr}\n"
    )
    proc = subprocess.Popen([str(REGISTRY), "serve", str(conf)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{addr}/v2/", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "registry did not start"
            time.sleep(0.1)
        name = f"registry.test:{port}"
        hosts = tmp_path / "certs.d"
        (hosts / name).mkdir(parents=True)
        (hosts / name / "hosts.toml").write_text(
            f'server = "http://{addr}"\n\n[host."http://{addr}"]\n'
            '  capabilities = ["pull", "resolve", "push"]\n'
        )
        yield name, hosts
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_restore_pulls_the_missing_image_by_digest_from_the_configured_registry(
    ctr_vms: tuple[CtrVm, CtrVm], registry: tuple[str, Path]
) -> None:
    vm1, vm2 = ctr_vms
    addr, hosts = registry
    ref = f"{addr}/spotguard/counter:1"
    vm1.ctr("images", "tag", IMAGE, ref)
    vm1.ctr("images", "push", "--hosts-dir", str(hosts), ref, IMAGE)
    job_dir = vm1.base.parent / "pulled"
    job_dir.mkdir()
    started = _ok(
        vm1, "run", "--container", f"containerd:{NS}/pulled", "-v", f"{job_dir}:/data",
        "--", ref, "/bin/sh", "-c", JOB,
    )  # fmt: skip
    assert started["job"] == f"containerd:{NS}/pulled"
    wait_lines(job_dir / "out", 8)
    store = f"file://{vm1.base.parent / 'store'}"
    _ok(vm1, "checkpoint", f"containerd:{NS}/pulled", "--to", store)
    url = f"{store}/containerd-{NS}-pulled/images/latest"
    assert ref not in vm2.ctr("images", "ls", "-q").split()

    # no registry configuration: ctr cannot reach registry.test, the pull fails, nothing is made
    said = _refused(vm2, "restore", url)
    assert f"pull of {addr}/spotguard/counter@sha256:" in said and "failed" in said, said
    assert vm2.ctr("containers", "ls", "-q").split() == []

    env = {**vm2.cli_env(), "SPOTGUARD_CONTAINER_CONTAINERD_HOSTS_DIR": str(hosts)}
    out = subprocess.run(
        ["spotguard", "restore", "--json", url], env=env, capture_output=True, text=True,
        timeout=180, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert ref in vm2.ctr("images", "ls", "-q").split()  # pulled, named as the job ran it
    wait_lines(job_dir / "out", LINES)
    time.sleep(0.3)
    assert (job_dir / "out").read_text() == EXPECTED
    shutil.rmtree(job_dir, ignore_errors=True)
