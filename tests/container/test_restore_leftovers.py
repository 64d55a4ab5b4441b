"""containerd unpacks a checkpoint it restores into a ``ctrd-checkpoint*`` directory under
its ``$XDG_RUNTIME_DIR`` (else its temp dir) and never removes it: every restore left a full
copy of the job's memory on the host — for a GPU job tens of GB, in RAM where that is a
tmpfs. docker's containerd does the same. spotguard removes the one its restore made, and
nothing else."""

from __future__ import annotations

from containerd_helpers import IMAGE, NS, CtrVm
from docker_helpers import IMAGE as DOCKER_IMAGE
from docker_helpers import DockerVm
from test_containerd import JOB, _ok, _task
from test_docker import JOB as DOCKER_JOB
from test_docker import _ok as _docker_ok

from sgtest import line_count, wait_lines


def _leftovers(vm: CtrVm) -> list[str]:
    return sorted(p.name for p in vm.runtime_dir.glob("ctrd-checkpoint*"))


def test_a_restore_leaves_no_copy_of_the_jobs_memory_in_containerds_runtime_dir(
    ctr_vms: tuple[CtrVm, CtrVm],
) -> None:
    vm1, _ = ctr_vms
    job_dir = vm1.base.parent / "job"
    job_dir.mkdir()
    _ok(
        vm1, "run", "--container", f"containerd:{NS}/ctr", "-v", f"{job_dir}:/data",
        "--", IMAGE, "/bin/sh", "-c", JOB,
    )  # fmt: skip
    wait_lines(job_dir / "out", 4)
    # another restore's directory (a user's, say, still being read): never touched
    theirs = vm1.runtime_dir / "ctrd-checkpoint0000"
    theirs.mkdir(parents=True)
    (theirs / "inventory.img").write_bytes(b"\x00" * 86)
    (theirs / "pages-1.img").write_bytes(b"\x01" * 4096)
    store = f"file://{vm1.base.parent / 'store'}"
    ck = _ok(vm1, "checkpoint", f"containerd:{NS}/ctr", "--to", store)
    assert ck["mode"] == "exit"
    counted = line_count(job_dir / "out")
    restored = _ok(vm1, "restore", f"{store}/containerd-{NS}-ctr/images/latest")
    assert restored["container"] == f"containerd:{NS}/ctr", restored
    assert _task(vm1, "ctr")[1] == "RUNNING"
    wait_lines(job_dir / "out", counted + 3)  # it counts on
    assert _leftovers(vm1) == [theirs.name], "the restore left its checkpoint's copy behind"
    assert (theirs / "pages-1.img").read_bytes() == b"\x01" * 4096


def test_a_docker_restore_leaves_no_copy_of_the_jobs_memory_in_containerds_temp_dir(
    docker_vms: tuple[DockerVm, DockerVm],
) -> None:
    """docker starts a container from its checkpoint through its containerd, which leaves
    the same copy: removed the same way."""
    vm1, _ = docker_vms
    job_dir = vm1.base.parent / "job"
    job_dir.mkdir()
    _docker_ok(
        vm1, "run", "--container", "docker:ctr", "-v", f"{job_dir}:/data",
        "--", DOCKER_IMAGE, "/bin/sh", "-c", DOCKER_JOB,
    )  # fmt: skip
    wait_lines(job_dir / "out", 4)
    theirs = vm1.runtime_dir / "ctrd-checkpoint0000"
    theirs.mkdir(parents=True)
    (theirs / "inventory.img").write_bytes(b"\x00" * 86)
    store = f"file://{vm1.base.parent / 'store'}"
    assert _docker_ok(vm1, "checkpoint", "docker:ctr", "--to", store)["mode"] == "exit"
    counted = line_count(job_dir / "out")
    _docker_ok(vm1, "restore", f"{store}/docker-ctr/images/latest")
    wait_lines(job_dir / "out", counted + 3)  # it counts on
    left = sorted(p.name for p in vm1.runtime_dir.glob("ctrd-checkpoint*"))
    assert left == [theirs.name], "the restore left its checkpoint's copy behind"
