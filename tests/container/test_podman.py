"""A podman container checkpointed to a store and restored as a new container on another
"VM", with real podman, runc and CRIU (issue 29): the output continues byte-identically; a
damaged image or a missing bind mount is refused before podman is asked to restore."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from podman_helpers import IMAGE, Vm

from sgtest import flip_a_byte
from sgtest import wait_lines as _wait_lines
from spotguard.container import ContainerImage, ContainerRef, Podman
from spotguard.container.checkpoint import checkpoint_container
from spotguard.container.restore import RestoreIntent, restore_container
from spotguard.container.start import start_container
from spotguard.errors import (
    ImageCorrupt,
    MissingMount,
    PreflightError,
    SpotguardError,
    UnsignedImage,
)
from spotguard.image import ImageReader, ImageSettings, generate_signing_key

LINES = 120
#: the job: one line per step into its bind-mounted output, holding the file open
JOB = f"exec >>/data/out; i=0; while [ $i -lt {LINES} ]; do echo $i; i=$((i+1)); sleep 0.05; done"
EXPECTED = "".join(f"{i}\n" for i in range(LINES))


def _cli(vm: Vm, *args: str) -> dict[str, object]:
    out = subprocess.run(
        ["spotguard", args[0], "--json", *args[1:]],
        env=vm.cli_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _data_dir(vm: Vm, name: str) -> Path:
    d = vm.state_dir.parent / name
    d.mkdir(parents=True)
    return d


def test_container_checkpointed_removed_and_restored_on_another_vm_continues_identically(
    vms: tuple[Vm, Vm],
) -> None:
    vm1, vm2 = vms
    ref_dir, job_dir = _data_dir(vm1, "ref"), _data_dir(vm1, "job")
    for name, d in (("ref", ref_dir), ("ctr", job_dir)):
        started = _cli(
            vm1, "run", "--container", f"podman:{name}", "-v", f"{d}:/data",
            "--", IMAGE, "/bin/sh", "-c", JOB,
        )  # fmt: skip
        assert started["job"] == f"podman:{name}"
    _wait_lines(job_dir / "out", 8)
    store = f"file://{vm1.state_dir.parent / 'store'}"
    ck = _cli(vm1, "checkpoint", "podman:ctr", "--to", store)
    assert ck["mode"] == "exit" and ck["job"] == "podman-ctr", ck
    at_checkpoint = (job_dir / "out").read_text()
    assert 8 <= at_checkpoint.count("\n") < LINES
    # exit mode: the container is gone from VM 1 once its image is durable
    assert not asyncio.run(vm1.podman.exists("container", "ctr"))
    time.sleep(0.5)
    assert (job_dir / "out").read_text() == at_checkpoint  # stopped, not running elsewhere

    url = f"{store}/podman-ctr/images/latest"
    record = asyncio.run(_record(url))
    assert record.config.name == "ctr" and record.config.image == IMAGE
    assert record.config.network_mode == "none"
    assert [(m.type, m.source, m.destination) for m in record.config.mounts] == [
        ("bind", str(job_dir), "/data")
    ]
    assert record.criu_version.startswith("4.")

    # VM 2's restorer is killed (SIGKILL) the moment podman has restored the container,
    # before it records the outcome; run again, it finds its own container by the ID its
    # intent names and takes it over: one container, restored once, the counter not rerun
    podman = vm2.podman.binary
    killer = vm2.state_dir.parent / "podman-then-die"
    killer.write_text(
        f'#!/bin/sh\ncase "$*" in *"container restore"*) {podman} "$@"; kill -9 $PPID;; '
        f'*) exec {podman} "$@";; esac\n'
    )
    killer.chmod(0o755)
    env = {
        **vm2.cli_env(),
        "SPOTGUARD_CONTAINER_PODMAN": str(killer),
        "SPOTGUARD_CONTAINER_RUNC": vm2.podman.runc,
    }
    died = subprocess.run(
        ["spotguard", "restore", "--json", url], env=env, capture_output=True, timeout=180
    )
    assert died.returncode == -9, died.stderr[-2000:]
    first = asyncio.run(vm2.podman.inspect("ctr"))
    assert first is not None and first["State"]["Status"] == "running"
    back = _cli(vm2, "restore", url)
    assert back["container"] == "podman:ctr" and back["id"] == first["Id"]
    assert vm2.podman_cmd("ps", "-a", "-q", "--no-trunc").split() == [first["Id"]]
    # both jobs write their last line and end (podman wait is slow to see it: up to 20 s)
    _wait_lines(job_dir / "out", LINES)
    _wait_lines(ref_dir / "out", LINES)
    time.sleep(0.3)
    assert (ref_dir / "out").read_text() == EXPECTED
    assert (job_dir / "out").read_text() == (ref_dir / "out").read_text()


async def _record(url: str) -> ContainerImage:
    async with ImageReader(url, settings=ImageSettings()) as r:
        return ContainerImage.from_meta(r.manifest.meta, url)


def _logged(vm: Vm, tmp: Path) -> tuple[Podman, Path]:
    """VM's podman behind a wrapper that records each command line (real podman runs)."""
    log = tmp / "podman-calls.log"
    wrapper = tmp / "podman-logged"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >>{log}\nexec {vm.podman.binary} "$@"\n')
    wrapper.chmod(0o755)
    p = vm.podman
    return Podman(str(wrapper), p.runc, p.criu, p.root, p.runroot, p.runtime_dir, p.timeout), log


async def _checkpoint_sleeper(vm: Vm, data: Path, store: str) -> str:
    ref = ContainerRef.parse("podman:sleeper")
    await start_container(
        ref, IMAGE, ["/bin/sh", "-c", JOB], podman=vm.podman, volumes=[f"{data}:/data"]
    )
    await asyncio.to_thread(_wait_lines, data / "out", 2)
    done = await checkpoint_container(
        ref, store, podman=vm.podman, image_settings=ImageSettings(), state_dir=vm.state_dir
    )
    return done.image_url


def _restores(log: Path) -> list[str]:
    calls = log.read_text().splitlines() if log.exists() else []
    return [c for c in calls if " restore" in c]


def test_a_flipped_byte_in_a_chunk_is_refused_before_podman_restores(
    vms: tuple[Vm, Vm], tmp_path: Path
) -> None:
    vm1, vm2 = vms
    store_dir = vm1.state_dir.parent / "store"
    url = asyncio.run(_checkpoint_sleeper(vm1, _data_dir(vm1, "d"), f"file://{store_dir}"))
    chunks = sorted((store_dir / "podman-sleeper" / "chunks").rglob("*"))
    victim = max((c for c in chunks if c.is_file()), key=lambda c: c.stat().st_size)
    flip_a_byte(victim)
    podman, log = _logged(vm2, tmp_path)
    with pytest.raises(ImageCorrupt, match=victim.name):
        asyncio.run(
            restore_container(
                url, podman=podman, image_settings=ImageSettings(), state_dir=vm2.state_dir
            )
        )
    assert _restores(log) == [] and not log.exists(), "podman was called"
    assert not asyncio.run(vm2.podman.exists("container", "sleeper"))
    leftovers = list((vm2.state_dir / "containers").iterdir())
    assert leftovers == [], leftovers  # the pulled archive is removed


def test_a_missing_bind_mount_is_refused_by_name_before_podman_restores(
    vms: tuple[Vm, Vm], tmp_path: Path
) -> None:
    vm1, vm2 = vms
    data = _data_dir(vm1, "gone")
    url = asyncio.run(_checkpoint_sleeper(vm1, data, f"file://{vm1.state_dir.parent / 'store'}"))
    os.rename(data, data.with_name("elsewhere"))
    podman, log = _logged(vm2, tmp_path)
    with pytest.raises(MissingMount, match=f"bind mount {data} .* does not exist"):
        asyncio.run(
            restore_container(
                url, podman=podman, image_settings=ImageSettings(), state_dir=vm2.state_dir
            )
        )
    assert _restores(log) == [], "podman was asked to restore"
    assert not asyncio.run(vm2.podman.exists("container", "sleeper"))
    # the mount back, a journal of an interrupted restore of this image, and a stranger
    # container of that name (not the ID the journal names): refused, the stranger untouched
    os.rename(data.with_name("elsewhere"), data)
    record = asyncio.run(_record(url))
    RestoreIntent(image_url=url, name="sleeper", id=record.config.id).save(vm2.state_dir)
    stranger = ContainerRef.parse("podman:sleeper")
    asyncio.run(start_container(stranger, IMAGE, ["/bin/sh", "-c", "sleep 600"], podman=podman))
    before = asyncio.run(vm2.podman.inspect("sleeper"))
    assert before is not None and before["Id"] != record.config.id
    with pytest.raises(PreflightError, match="a container named 'sleeper' exists"):
        asyncio.run(
            restore_container(
                url, podman=podman, image_settings=ImageSettings(), state_dir=vm2.state_dir
            )
        )
    after = asyncio.run(vm2.podman.inspect("sleeper"))
    assert after is not None and after["Id"] == before["Id"]
    assert after["State"]["Status"] == "running" and _restores(log) == []


def test_an_exit_checkpoint_whose_image_cannot_be_stored_brings_the_container_back(
    vms: tuple[Vm, Vm], tmp_path: Path
) -> None:
    vm1, _ = vms
    data = _data_dir(vm1, "back")
    ref = ContainerRef.parse("podman:back")
    big = "s=x; n=0; while [ $n -lt 22 ]; do s=$s$s; n=$((n+1)); done; "  # 4 MiB of heap
    asyncio.run(
        start_container(
            ref, IMAGE, ["/bin/sh", "-c", big + JOB], podman=vm1.podman, volumes=[f"{data}:/data"]
        )
    )
    _wait_lines(data / "out", 5)
    # the store takes the image's marker but no chunk: the upload fails while podman streams
    # its export into it (podman must not be left waiting on a full pipe)
    store = tmp_path / "store"
    (store / "podman-back").mkdir(parents=True)
    (store / "podman-back" / "chunks").write_text("not a directory")
    with pytest.raises(SpotguardError):
        asyncio.run(
            checkpoint_container(
                ref,
                f"file://{store}",
                podman=vm1.podman,
                image_settings=ImageSettings(chunk_size=64 << 10),  # the archive: many chunks
                state_dir=vm1.state_dir,
            )
        )
    ctr = asyncio.run(vm1.podman.inspect("back"))
    assert ctr is not None and ctr["State"]["Status"] == "running", ctr and ctr["State"]
    _wait_lines(data / "out", (data / "out").read_text().count("\n") + 5)
    asyncio.run(vm1.podman.run("rm", "--force", "--time", "0", "back", what="ending the job"))
    text = (data / "out").read_text()
    assert text == EXPECTED[: len(text)]  # continued: no line lost or repeated


def test_leave_running_keeps_the_container_and_carries_its_writable_layer(
    vms: tuple[Vm, Vm],
) -> None:
    vm1, vm2 = vms
    inner = JOB.replace("/data/out", "/tmp/out")  # in the container's own writable layer
    ref = ContainerRef.parse("podman:lr")
    asyncio.run(start_container(ref, IMAGE, ["/bin/sh", "-c", inner], podman=vm1.podman))

    def inside(vm: Vm) -> str:  # the file as the container sees it (no cat in the image)
        read = 'while IFS= read -r line; do echo "$line"; done </tmp/out'
        return vm.podman_cmd("exec", "lr", "/bin/sh", "-c", read)

    end = time.monotonic() + 30
    while inside(vm1).count("\n") < 8:
        assert time.monotonic() < end
        time.sleep(0.1)
    done = asyncio.run(
        checkpoint_container(
            ref,
            f"file://{vm1.state_dir.parent / 'store'}",
            podman=vm1.podman,
            image_settings=ImageSettings(),
            state_dir=vm1.state_dir,
            leave_running=True,
        )
    )
    assert done.mode == "resume"
    at_dump = inside(vm1)
    time.sleep(0.5)
    assert len(inside(vm1)) > len(at_dump)  # still running on VM 1
    asyncio.run(
        restore_container(
            done.image_url,
            podman=vm2.podman,
            image_settings=ImageSettings(),
            state_dir=vm2.state_dir,
        )
    )
    time.sleep(0.5)
    there, here = inside(vm2), inside(vm1)
    # the layer came along as it was at the dump, and both copies went on from there: every
    # number once, in order (podman's own --leave-running wrote one twice)
    assert there.count("\n") > 8 and there == EXPECTED[: len(there)], there
    assert here == EXPECTED[: len(here)], here


def test_container_images_are_signed_and_an_unsigned_one_is_refused_before_podman(
    vms: tuple[Vm, Vm], tmp_path: Path
) -> None:
    vm1, vm2 = vms
    private, public = generate_signing_key()
    (tmp_path / "sign.pem").write_bytes(private)
    (tmp_path / "verify.pem").write_bytes(public)
    signing = ImageSettings(signing_key_file=tmp_path / "sign.pem")
    verifying = ImageSettings(verify_key_file=tmp_path / "verify.pem")
    store = f"file://{vm1.state_dir.parent / 'store'}"

    async def checkpoint(name: str, settings: ImageSettings) -> str:
        ref = ContainerRef.parse(f"podman:{name}")
        await start_container(ref, IMAGE, ["/bin/sh", "-c", "sleep 600"], podman=vm1.podman)
        done = await checkpoint_container(
            ref, store, podman=vm1.podman, image_settings=settings, state_dir=vm1.state_dir
        )
        return done.image_url

    signed, unsigned = (
        asyncio.run(checkpoint("s1", signing)),
        asyncio.run(checkpoint("u1", ImageSettings())),
    )
    podman, log = _logged(vm2, tmp_path)
    with pytest.raises(UnsignedImage):
        asyncio.run(
            restore_container(
                unsigned, podman=podman, image_settings=verifying, state_dir=vm2.state_dir
            )
        )
    assert _restores(log) == [], "podman was asked to restore an unsigned image"
    done = asyncio.run(
        restore_container(signed, podman=podman, image_settings=verifying, state_dir=vm2.state_dir)
    )
    assert done.container == "podman:s1"
    ctr = asyncio.run(vm2.podman.inspect("s1"))
    assert ctr is not None and ctr["State"]["Status"] == "running"
