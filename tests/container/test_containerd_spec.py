"""containerd writes the container's runtime spec into its content store at every
checkpoint and fails the checkpoint when that blob is already there — after ``--exit`` has
ended the task and deleted CRIU's files. A checkpoint image of the same container that the
user made with ``ctr`` (or one of spotguard's own not yet collected) holds such a blob:
spotguard's exit checkpoint must neither lose the job nor break the user's image."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest
from containerd_helpers import IMAGE, NS, CtrVm
from test_containerd import JOB, _ok, _record, _task

from sgtest import wait_lines
from spotguard.checkpoint.procfacts import start_time
from spotguard.container import ContainerRef
from spotguard.container.ctrspec import clear_spec, put_back, recover_held


def _index_refs(vm: CtrVm, image: str) -> list[str]:
    """The digests the index of ``image`` names (its gc.ref labels)."""
    digest = next(
        ln.split()[2] for ln in vm.ctr("images", "ls").splitlines()[1:] if ln.split()[0] == image
    )
    for line in vm.ctr("content", "ls").splitlines()[1:]:
        if line.startswith(digest):
            labels = line.split()[-1]
            return [kv.split("=", 1)[1] for kv in labels.split(",") if "gc.ref.content" in kv]
    raise AssertionError(f"index {digest} of {image} not in the content store")


def _counter(vm: CtrVm) -> None:
    """The test's job in container ``ctr``, running once it has written its first lines."""
    job_dir = vm.base.parent / "job"
    job_dir.mkdir()
    _ok(
        vm, "run", "--container", f"containerd:{NS}/ctr", "-v", f"{job_dir}:/data",
        "--", IMAGE, "/bin/sh", "-c", JOB,
    )  # fmt: skip
    wait_lines(job_dir / "out", 4)


def _content_of(vm: CtrVm, digest: str) -> bytes:
    got = subprocess.run(
        vm.ctrd.argv(NS, "content", "get", digest), capture_output=True, env=vm.ctrd.env()
    )
    return got.stdout


def _blobs(vm: CtrVm) -> set[str]:
    return {ln.split()[0] for ln in vm.ctr("content", "ls").splitlines()[1:]}


def test_an_exit_checkpoint_beside_a_users_ctr_checkpoint_of_the_container_keeps_both(
    ctr_vms: tuple[CtrVm, CtrVm],
) -> None:
    vm1, _ = ctr_vms
    _counter(vm1)
    users = vm1.ctr("tasks", "checkpoint", "ctr").strip().splitlines()[-1]
    refs = _index_refs(vm1, users)
    store = f"file://{vm1.base.parent / 'store'}"
    ck = _ok(vm1, "checkpoint", f"containerd:{NS}/ctr", "--to", store)
    assert ck["mode"] == "exit", ck
    record = asyncio.run(_record(f"{store}/containerd-{NS}-ctr/images/latest"))
    assert record.config.name == "ctr"
    assert _task(vm1, "ctr") == ("", "")  # gone once durable, not left stopped
    # the user's checkpoint image still has every blob its index names
    for digest in refs:
        assert "sha256:" + hashlib.sha256(_content_of(vm1, digest)).hexdigest() == digest
    assert set(refs) <= _blobs(vm1), set(refs) - _blobs(vm1)


def test_a_leave_running_then_an_exit_checkpoint_at_once_both_succeed(
    ctr_vms: tuple[CtrVm, CtrVm],
) -> None:
    """The leave-running checkpoint's own scratch image, removed right before, must not be
    in the way (containerd collects removed content later, unless asked to at once)."""
    vm1, _ = ctr_vms
    _counter(vm1)
    store = f"file://{vm1.base.parent / 'store'}"
    first = _ok(vm1, "checkpoint", f"containerd:{NS}/ctr", "--to", store, "--leave-running")
    assert first["mode"] != "exit" and _task(vm1, "ctr")[1] == "RUNNING"
    t0 = time.monotonic()
    second = _ok(vm1, "checkpoint", f"containerd:{NS}/ctr", "--to", store)
    assert second["mode"] == "exit", (second, time.monotonic() - t0)
    listing = vm1.ctr("images", "ls", "-q").split()
    assert not [i for i in listing if i.startswith("spotguard.local/checkpoint/")], listing


def test_a_spec_blob_moved_aside_comes_back_when_the_checkpoint_did_not_write_it(
    ctr_vms: tuple[CtrVm, CtrVm],
) -> None:
    """The checkpoint failing before containerd wrote the spec again: the user's image gets
    its blob back, byte for byte; with no image naming it, it stays deleted."""
    vm1, _ = ctr_vms
    _counter(vm1)
    users = vm1.ctr("tasks", "checkpoint", "ctr").strip().splitlines()[-1]
    ref = ContainerRef.parse(f"containerd:{NS}/ctr")
    state = vm1.base / "spotguard-state"
    held = asyncio.run(clear_spec(vm1.ctrd, ref, state))
    assert held is not None and held.named and held.digest in _index_refs(vm1, users)
    assert held.digest not in _blobs(vm1)
    assert held.kept is not None and held.kept.read_bytes().endswith(held.data)
    asyncio.run(put_back(vm1.ctrd, NS, held))
    assert _content_of(vm1, held.digest) == held.data
    assert not held.kept.exists()  # back in the store: no copy kept
    vm1.ctr("images", "rm", "--sync", users)
    assert held.digest not in _blobs(vm1)  # collected with the user's image
    assert asyncio.run(clear_spec(vm1.ctrd, ref, state)) is None  # nothing in the way now


def _clear_then_die(vm: CtrVm, ref: ContainerRef, state: Path) -> None:
    """A spotguard killed between moving the spec blob aside and putting it back: a forked
    child that moves it aside and ends without another step."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            asyncio.run(clear_spec(vm.ctrd, ref, state))
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0


def test_a_spec_blob_a_killed_checkpoint_moved_aside_is_put_back(
    ctr_vms: tuple[CtrVm, CtrVm],
) -> None:
    """Killed in that window, spotguard left the user's checkpoint image without its spec
    blob for good. The bytes are kept in the state dir first; the next containerd checkpoint
    (or the agent as it starts guarding a container) writes them back — never while the
    spotguard that moved them still runs."""
    vm1, _ = ctr_vms
    _counter(vm1)
    users = vm1.ctr("tasks", "checkpoint", "ctr").strip().splitlines()[-1]
    refs = _index_refs(vm1, users)
    ref = ContainerRef.parse(f"containerd:{NS}/ctr")
    state = vm1.base / "spotguard-state"
    _clear_then_die(vm1, ref, state)
    missing = set(refs) - _blobs(vm1)
    assert len(missing) == 1, missing  # the window: the user's image lacks its spec
    live = state / "containers" / "held-specs" / f"{os.getpid()}-{start_time('self')}-{'0' * 64}"
    live.write_bytes(b"sg\n")  # a running spotguard's (this process): left alone
    assert asyncio.run(recover_held(vm1.ctrd, state)) == list(missing)
    assert set(refs) <= _blobs(vm1)
    for digest in refs:
        assert "sha256:" + hashlib.sha256(_content_of(vm1, digest)).hexdigest() == digest
    assert sorted(p.name for p in live.parent.iterdir()) == [live.name]


def _checkpoint_names(container: str, start: float, seconds: int) -> list[str]:
    """The names ``ctr tasks checkpoint`` gives a checkpoint of ``container`` started in each
    of ``seconds`` seconds from ``start`` (its own clock format, to the second)."""
    return [
        f"containerd.io/checkpoint/{container}:"
        + time.strftime("%m-%d-%Y-%H:%M:%S", time.localtime(start + i))
        for i in range(seconds)
    ]


def test_an_exit_checkpoint_in_the_same_second_as_a_users_ctr_checkpoint_keeps_the_job(
    ctr_vms: tuple[CtrVm, CtrVm],
) -> None:
    """``ctr tasks checkpoint`` names its image after the container and the second it
    started, and fails creating it when that name exists — after ``--exit`` ended the task.
    A user's checkpoint in the same second as spotguard's (here: the user's image under the
    names of this second and the next few, so the clash does not hang on timing) must not
    cost the job."""
    vm1, _ = ctr_vms
    _counter(vm1)
    users = vm1.ctr("tasks", "checkpoint", "ctr").strip().splitlines()[-1]
    for name in _checkpoint_names("ctr", time.time(), 4):
        if name != users:
            vm1.ctr("images", "tag", users, name)
    store = f"file://{vm1.base.parent / 'store'}"
    ck = _ok(vm1, "checkpoint", f"containerd:{NS}/ctr", "--to", store)
    assert ck["mode"] == "exit", ck
    assert _task(vm1, "ctr") == ("", "")
    record = asyncio.run(_record(f"{store}/containerd-{NS}-ctr/images/latest"))
    assert record.config.name == "ctr"
    assert users in vm1.ctr("images", "ls", "-q").split()  # the user's image untouched


def test_a_state_dir_that_cannot_keep_the_blob_still_moves_it_aside(
    ctr_vms: tuple[CtrVm, CtrVm], caplog: pytest.LogCaptureFixture
) -> None:
    """Keeping the bytes is for a spotguard killed midway; where the state dir cannot take
    them the blob is still moved aside (its bytes in memory) — the checkpoint failing on it
    would cost the job. Put back at once, before containerd collected the removed blob,
    ``ctr content ingest`` from a pipe failed ("unable to resume write ... illegal seek")
    in about one run of three: the user's image kept no spec."""
    vm1, _ = ctr_vms
    _counter(vm1)
    users = vm1.ctr("tasks", "checkpoint", "ctr").strip().splitlines()[-1]
    state = vm1.base / "spotguard-state"
    (state / "containers").mkdir(parents=True, exist_ok=True)
    (state / "containers" / "held-specs").write_text("not a directory")
    ref = ContainerRef.parse(f"containerd:{NS}/ctr")
    held = asyncio.run(clear_spec(vm1.ctrd, ref, state))
    assert held is not None and held.kept is None and held.digest not in _blobs(vm1)
    asyncio.run(put_back(vm1.ctrd, NS, held))  # moments after: containerd has not collected it
    said = [getattr(r, "error", "") for r in caplog.records]
    assert held.digest in _index_refs(vm1, users) and held.digest in _blobs(vm1), said
