"""Container job names, the typed record and the archive's path move, without podman."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from spotguard import workdirs
from spotguard.checkpoint.procfacts import start_time
from spotguard.container.archive import relocate
from spotguard.container.checkpoint import work_dir
from spotguard.container.spec import ContainerImage, ContainerRef, is_container_job
from spotguard.errors import ImageError, JobError


def test_container_job_names_parse_and_refuse_clearly() -> None:
    ref = ContainerRef.parse("podman:Train_1")
    assert (ref.runtime, ref.name, ref.job, str(ref)) == (
        "podman",
        "Train_1",
        "podman-train_1",
        "podman:Train_1",
    )
    assert is_container_job("podman:x") and is_container_job("docker:x")
    assert not is_container_job("train-1") and not is_container_job("1234")
    docker = ContainerRef.parse("docker:Web.1")
    assert (docker.runtime, docker.name, docker.job, str(docker)) == (
        "docker", "Web.1", "docker-web.1", "docker:Web.1"
    )  # fmt: skip
    with pytest.raises(JobError, match="docker names are 2-128"):
        ContainerRef.parse("docker:x")  # docker's names have at least 2 characters
    with pytest.raises(JobError, match="is not a container job: use podman:NAME, docker:NAME"):
        ContainerRef.parse("crio:x")
    with pytest.raises(JobError, match="invalid container name"):
        ContainerRef.parse("podman:../x")


def test_containerd_job_names_parse_by_containerds_rules_and_refuse_clearly() -> None:
    ref = ContainerRef.parse("containerd:k8s.io/Train_1")
    assert (ref.runtime, ref.namespace, ref.name) == ("containerd", "k8s.io", "Train_1")
    assert (ref.job, str(ref)) == ("containerd-k8s.io-train_1", "containerd:k8s.io/Train_1")
    assert ContainerRef.parse(str(ref)) == ref and is_container_job(str(ref))
    long = ContainerRef.parse(f"containerd:ns/{'a' * 76}")
    assert len(long.job) == 63 and long.job.startswith("containerd-ns-aaa")
    for bad, says in (
        ("containerd:onlyid", "containerd:NAMESPACE/ID"),
        ("containerd:/x", "invalid containerd namespace ''"),
        ("containerd:ns/", "invalid containerd container ID ''"),
        ("containerd:ns/a/b", "invalid containerd container ID 'a/b'"),
        ("containerd:ns/a..b", "invalid containerd container ID 'a..b'"),
        ("containerd:ns/-a", "invalid containerd container ID '-a'"),
        (f"containerd:ns/{'a' * 77}", "1-76 of a-z"),
        ("containerd:n s/x", "invalid containerd namespace 'n s'"),
    ):
        with pytest.raises(JobError, match=re.escape(says)):
            ContainerRef.parse(bad)


def test_a_process_image_is_not_taken_for_a_container_image() -> None:
    with pytest.raises(ImageError, match="is not a container image"):
        ContainerImage.from_meta({"timeline": []}, "file:///s/j/images/1")
    with pytest.raises(ImageError, match="container record is malformed"):
        ContainerImage.from_meta({"kind": "container", "container": {"mode": "x"}}, "u")


def _tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


def _extracted(path: Path, tmp: Path) -> dict[str, object]:
    out = tmp / "x"
    out.mkdir()
    subprocess.run(["tar", "-C", str(out), "-xf", str(path)], check=True)  # as podman: last wins
    return {name: json.loads((out / name).read_text()) for name in ("config.dump", "spec.dump")}


def test_podman_storage_paths_move_to_the_target_roots_by_appending(tmp_path: Path) -> None:
    config = {
        "conmonPidFile": "/old/run/overlay-containers/c1/userdata/conmon.pid",
        "staticDir": "/old/lib/overlay-containers/c1/userdata",
        "mounts": ["/old/lib/overlay-containers/c1/userdata/shm"],
        "other": "/old/library/x",  # not under /old/lib: a prefix of the name only
    }
    spec = {"root": {"path": "/old/lib/overlay/l1/merged"}, "mounts": [{"source": "/data"}]}
    archive = tmp_path / "a.tar"
    members = {"config.dump": json.dumps(config).encode(), "spec.dump": json.dumps(spec).encode()}
    _tar(archive, {**members, "checkpoint/pages-1.img": b"\0" * 4096})
    size = archive.stat().st_size
    moved = relocate(archive, {"/old/lib": "/new/lib", "/old/run": "/new/run/"})
    assert moved == ["config.dump", "spec.dump"]
    assert archive.stat().st_size < size + 8 * 4096  # appended, not copied
    got = _extracted(archive, tmp_path)
    assert got["config.dump"] == {
        "conmonPidFile": "/new/run/overlay-containers/c1/userdata/conmon.pid",
        "staticDir": "/new/lib/overlay-containers/c1/userdata",
        "mounts": ["/new/lib/overlay-containers/c1/userdata/shm"],
        "other": "/old/library/x",
    }
    assert got["spec.dump"] == {
        "root": {"path": "/new/lib/overlay/l1/merged"},
        "mounts": [{"source": "/data"}],
    }
    assert relocate(archive, {"/same": "/same"}) == []


def test_cli_refuses_a_bad_container_name_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run(
        ["spotguard", "checkpoint", "docker:w", "--to", f"file://{tmp_path}/store"],
        capture_output=True,
        text=True,
        env={**os.environ, "SPOTGUARD_STATE_DIR": str(tmp_path / "state")},
        check=False,
    )
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "invalid container name 'w': docker names are 2-128" in out.stderr, out.stderr


def test_work_dirs_left_by_a_killed_run_are_removed_after_a_day(tmp_path: Path) -> None:
    old = work_dir(tmp_path)
    (old / "podman-checkpoint.tar").write_bytes(b"x" * 10)
    young = work_dir(tmp_path)
    day_ago = time.time() - 25 * 3600
    os.utime(old, (day_ago, day_ago))
    fresh = work_dir(tmp_path)
    assert not old.exists() and young.is_dir() and fresh.is_dir()
    assert (tmp_path / "containers").stat().st_mode & 0o777 == 0o700


def test_a_containerd_restore_pulls_the_exact_image_only_from_a_registry() -> None:
    """A missing image is pulled by the digest the container ran (never by a tag that may
    have moved), and only where a registry host names it."""
    from spotguard.container.containerd_ops import pull_reference

    digest = "sha256:" + "ab" * 32
    assert pull_reference("nvcr.io/nvidia/pytorch:25.01-py3", digest) == (
        f"nvcr.io/nvidia/pytorch@{digest}"
    )
    assert (
        pull_reference("registry:5000/team/train", digest) == f"registry:5000/team/train@{digest}"
    )
    assert pull_reference(f"docker.io/library/busybox@{digest}", digest) == (
        f"docker.io/library/busybox@{digest}"
    )
    for local in ("localhost/sg-counter:1", "sg-counter:1", "team/train:2"):
        assert pull_reference(local, digest) is None, local
    assert pull_reference("nvcr.io/nvidia/pytorch:1", "not-a-digest") is None


def test_a_work_dir_a_killed_run_left_is_removed_at_once(tmp_path: Path) -> None:
    """A container's archive is as large as its memory: the one a killed spotguard left goes
    at the next work directory, not a day later; a live process's stays."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    started = start_time(child.pid)
    child.kill()
    child.wait()
    mine = work_dir(tmp_path)
    killed = mine.parent / f"ckpt-{child.pid}.{started}.{workdirs.pid_namespace()}-abcd1234"
    killed.mkdir()
    (killed / "containerd-checkpoint.tar").write_bytes(b"x" * 10)
    fresh = work_dir(tmp_path)
    assert not killed.exists() and mine.is_dir() and fresh.is_dir()
