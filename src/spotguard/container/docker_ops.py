"""docker containers (``docker:NAME``): start, checkpoint into a store, restore.

Checkpoint (each step timed in the result's timeline)::

    docker inspect (running? config, image ID and digests) ─► image writer opened (an unusable
      store fails here, before the job stops) ─► GPU processes locked and checkpointed
      (:mod:`.gpu`) ─► docker checkpoint create --checkpoint-dir (runc dumps the container
      with spotguard's CRIU; the container exits) ─► the writable layer (the overlay2 upper
      dir, tarred with its whiteouts and xattrs) ─► leave-running: restored in place, its GPU
      processes restored and unlocked ─► one archive: CRIU's images, the layer, docker's
      inspect ─► image writer (signed manifest LAST, the typed ContainerImage record with the
      host's GPUs in its meta) ─► exit mode: the container removed

docker's checkpoint holds CRIU's images only: the writable layer and the container's config
are spotguard's to carry. ``docker checkpoint create --leave-running`` is not used: the layer
would be read after the processes went on (podman's lesson: a line written twice); the price
is a pause covering dump, layer and restore in place.

Restore: pull (verified) ─► the record ─► preflight (the name is free, the image is here with
the recorded ID or pulled by digest, every bind mount source, volume and device exists, the
image's GPUs map onto this host's) ─► ``docker create`` with the recorded config and
spotguard's runtime ─► the layer unpacked into the new container's upper dir, CRIU's images
into its checkpoint directory (docker 20.10 refuses ``--checkpoint-dir`` on start) ─►
``docker start --checkpoint`` ─► its GPU processes restored (onto the mapped GPUs) and
unlocked. A failure after the create removes the new container.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spotguard.container import ctrtemp
from spotguard.container.checkpoint import ContainerCheckpoint, work_dir
from spotguard.container.docker import Docker
from spotguard.container.gpu import for_container
from spotguard.container.restore import ContainerRestore, RestoreIntent
from spotguard.container.spec import DOCKER_ARCHIVE, ContainerConfig, ContainerImage, ContainerRef
from spotguard.container.start import NPROC, nofile_limit
from spotguard.errors import (
    ConfigError,
    ContainerError,
    ImageError,
    JobError,
    JobNotFound,
    MismatchError,
    MissingMount,
    PreflightError,
    SpotguardError,
)
from spotguard.image.settings import ImageSettings
from spotguard.image.transfer import pull_dir
from spotguard.image.writer import ImageWriter
from spotguard.modes import Mode
from spotguard.timeline import Timeline

log = logging.getLogger(__name__)

#: the checkpoint's name under docker (in the container's checkpoints directory)
CHECKPOINT = "spotguard"
#: the archive's members
INSPECT, LAYER, IMAGES = "container.json", "rootfs-diff.tar", "checkpoint"
#: GNU tar's options that keep an overlay upper dir as it is (whiteouts, opaque dirs, owners)
TAR_KEEP = [
    "--xattrs",
    "--xattrs-include=trusted.*",
    "--xattrs-include=security.*",
    "--numeric-owner",
]
MAX_INSPECT_BYTES = 4 << 20


async def _sh(*argv: str, what: str, limit_s: float) -> None:
    """Run a helper (tar); ContainerError with its last words on failure."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), limit_s)
    if proc.returncode != 0:
        raise ContainerError(f"{what}: {err.decode(errors='replace').strip()[-400:]}")


async def start_docker(
    ref: ContainerRef,
    image: str,
    args: Sequence[str],
    *,
    docker: Docker,
    volumes: Sequence[str] = (),
    env: Sequence[str] = (),
    devices: Sequence[str] = (),
    network: str = "none",
) -> str:
    """Start ``image`` with ``args`` as the detached container ``ref`` with spotguard's
    runtime (the daemon's ``docker_runtime`` entry), bounded ``nofile``/``nproc``; its ID."""
    if await docker.inspect(ref.name) is not None:
        raise JobError(f"a container named {ref.name!r} already exists (docker rm it first)")
    argv = ["run", "--detach", "--name", ref.name, "--network", network]
    argv += ["--runtime", docker.runtime_name]
    argv += ["--ulimit", f"nofile={nofile_limit()}", "--ulimit", f"nproc={NPROC}:{NPROC}"]
    for v in volumes:
        argv += ["--volume", v]
    for e in env:
        argv += ["--env", e]
    for d in devices:
        argv += ["--device", d]
    out = await docker.run(*argv, image, *args, what=f"starting {ref}")
    return out.strip().splitlines()[-1] if out.strip() else ""


def config_of(ctr: dict[str, Any], image: dict[str, Any] | None) -> ContainerConfig:
    """The record of a container from ``docker inspect`` (podman's inspect follows docker's:
    the same reader, then docker's own name and image reference)."""
    cfg = ContainerConfig.from_inspect(
        {**ctr, "ImageName": (ctr.get("Config") or {}).get("Image")}, image
    )
    return cfg.model_copy(update={"name": str(ctr.get("Name") or "").lstrip("/")})


async def inspect_running(docker: Docker, ref: ContainerRef) -> dict[str, Any]:
    """``docker inspect`` of the running container; JobNotFound / JobError otherwise."""
    ctr = await docker.inspect(ref.name)
    if ctr is None:
        raise JobNotFound(f"no docker container {ref.name!r} on this host")
    status = str((ctr.get("State") or {}).get("Status", "unknown"))
    if status != "running":
        raise JobError(f"container {ref} is {status}, not running: nothing to checkpoint")
    return ctr


async def checkpoint_docker(
    ref: ContainerRef,
    store_url: str,
    *,
    docker: Docker,
    image_settings: ImageSettings,
    state_dir: Path,
    leave_running: bool = False,
    tcp_established: bool = False,
    meta: dict[str, Any] | None = None,
    on_frozen: Callable[[float], None] | None = None,
) -> ContainerCheckpoint:
    """Checkpoint the running docker container ``ref`` into a new image of ``ref.job`` in
    the store (exit mode: the container is removed once the image is durable)."""
    if tcp_established:
        raise ConfigError(
            "--tcp-established is not supported for docker containers: docs/limits.md"
        )
    tl = Timeline()
    mode = Mode.RESUME if leave_running else Mode.EXIT
    with tl.step("inspect"):
        ctr = await inspect_running(docker, ref)
        config = config_of(ctr, await docker.image_inspect(str(ctr.get("Image", ""))))
        upper = str(((ctr.get("GraphDriver") or {}).get("Data") or {}).get("UpperDir") or "")
        if not upper:
            raise JobError(f"{ref} has no overlay upper dir (storage driver overlay2 is needed)")
        version = await docker.version()
    tmp = await asyncio.to_thread(work_dir, state_dir)
    archive, images = tmp / DOCKER_ARCHIVE, tmp / "parts" / IMAGES
    writer = ImageWriter(store_url, ref.job, settings=image_settings, timeline=tl)
    gpu = for_container(docker, ref)
    dumped = False
    try:
        async with writer:  # first: a store that cannot take the image fails before the stop
            with tl.step("docker checkpoint", mode=mode, streamed=False) as dump:
                await asyncio.to_thread(os.makedirs, images.parent, 0o700)
                await gpu.freeze(tl)  # GPU memory into the processes' host memory first
                await docker.checkpoint(ref.name, ref.job, images.parent, CHECKPOINT)
                await asyncio.to_thread(os.rename, images.parent / CHECKPOINT, images)
                dumped = True
                await _sh(
                    "tar", "-C", upper, *TAR_KEEP, "-cf", str(images.parent / LAYER), ".",
                    what=f"the writable layer of {ref}", limit_s=docker.timeout,
                )  # fmt: skip
            frozen_at = time.time()
            pause_s: float | None = None
            if leave_running:
                with tl.step("docker restore in place"):
                    await _in_place(docker, ref, str(ctr["Id"]), images)
                if not gpu.already:  # a container parked in memory stays off the GPU
                    await gpu.thaw(tl)
                pause_s = time.time() - dump.start
            if on_frozen is not None:
                on_frozen(frozen_at)
            with tl.step("push", image=writer.url):
                data = json.dumps(ctr).encode()
                await asyncio.to_thread((images.parent / INSPECT).write_bytes, data)
                await _sh(
                    "tar", "-C", str(images.parent), "--numeric-owner", "-cf", str(archive),
                    INSPECT, LAYER, IMAGES, what="the archive", limit_s=docker.timeout,
                )  # fmt: skip
                size = (await writer.add_file(archive, DOCKER_ARCHIVE)).size
                record = ContainerImage(
                    runtime="docker", runtime_version=version, criu_version=docker.criu_version(),
                    mode=mode, archive=DOCKER_ARCHIVE, archive_bytes=size, config=config,
                    gpu=gpu.record(),
                )  # fmt: skip
                await writer.commit({**(meta or {}), **record.to_meta()})
        durable_at = time.time()
    except BaseException:
        if not leave_running and dumped:  # exit mode: never leave the job stopped
            await _bring_back(docker, ref, str(ctr["Id"]), images)
        if gpu.frozen:  # ... nor its GPU processes checkpointed or locked
            await gpu.thaw_quietly(tl)
        raise
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    log.info("container checkpointed", extra={"job": ref.job, "image": writer.url, "mode": mode})
    if not leave_running:
        with tl.step("remove"):
            await docker.run("rm", ref.name, what=f"removing {ref} (image durable)")
    return ContainerCheckpoint(
        container=str(ref), job=ref.job, image_url=writer.url, mode=mode,
        bytes=record.archive_bytes, stored_bytes=writer.stats.stored_bytes, timeline=tl,
        stats=writer.stats, frozen_at=frozen_at, freeze_seconds=frozen_at - dump.start,
        pause_seconds=pause_s, durable_at=durable_at, streamed=False,
    )  # fmt: skip


#: ``docker start --checkpoint`` tries while containerd still holds the checkpoint's content
IN_PLACE_TRIES = 4


async def _in_place(docker: Docker, ref: ContainerRef, cid: str, images: Path) -> None:
    """Restore the (exited) container ``cid`` from CRIU's images in ``images`` (a copy goes
    into its checkpoints directory, where ``docker start --checkpoint`` reads it)."""
    target = await docker.root_dir() / "containers" / cid / "checkpoints" / CHECKPOINT
    await asyncio.to_thread(shutil.rmtree, target, True)
    await asyncio.to_thread(shutil.copytree, images, target, symlinks=True)
    try:  # containerd's own copy of the checkpoint removed after (ctrtemp)
        async with ctrtemp.removing_leftovers(lambda: ctrtemp.CriuFiles.of_dir(target)):
            await _start_from_checkpoint(docker, ref)
    finally:
        await asyncio.to_thread(shutil.rmtree, target, True)


async def _start_from_checkpoint(docker: Docker, ref: ContainerRef) -> None:
    """``docker start --checkpoint``, tried again while containerd still holds the
    checkpoint's content."""
    for attempt in range(IN_PLACE_TRIES):
        try:
            await docker.run(
                "start", "--checkpoint", CHECKPOINT, ref.name, what=f"restoring {ref} in place"
            )
            return
        except ContainerError as exc:
            # the checkpoint's own upload into containerd (docker checkpoint create) is
            # still in its content store until containerd's garbage collection runs, and
            # docker's upload of the same bytes then fails "already exists" (seen on a
            # loaded host): wait for the collection and start again
            if "already exists" not in str(exc) or attempt == IN_PLACE_TRIES - 1:
                raise
            log.warning("restore in place waits for containerd", extra={"error": str(exc)})
            await asyncio.sleep(1.0 + attempt)


async def _bring_back(docker: Docker, ref: ContainerRef, cid: str, images: Path) -> None:
    """Exit mode, the image not durable: restore the container in place from its checkpoint
    unless it runs; logged, never raised over the error that brought us here."""
    try:
        ctr = await docker.inspect(ref.name)
        if ctr is not None and (ctr.get("State") or {}).get("Status") == "running":
            return
        await _in_place(docker, ref, cid, images)
        log.warning("container restored in place after a failed checkpoint", extra={"job": ref.job})
    except SpotguardError as exc:
        log.error(
            "container could not be brought back after a failed checkpoint",
            extra={"job": ref.job, "error": str(exc)},
        )


def create_args(ctr: dict[str, Any], name: str, runtime: str) -> list[str]:
    """``docker create`` arguments that recreate the inspected container under ``name``: its
    image (by ID), entrypoint and command, env, working dir, user, hostname, binds and
    volumes, network, devices, limits — with spotguard's runtime."""
    cfg, host = ctr.get("Config") or {}, ctr.get("HostConfig") or {}
    argv = ["create", "--name", name, "--runtime", runtime]
    argv += ["--network", str(host.get("NetworkMode") or "none")]
    for key, flag in (("WorkingDir", "--workdir"), ("User", "--user"), ("Hostname", "--hostname")):
        if cfg.get(key):
            argv += [flag, str(cfg[key])]
    for e in cfg.get("Env") or []:
        argv += ["--env", str(e)]
    for label, value in (cfg.get("Labels") or {}).items():
        argv += ["--label", f"{label}={value}"]
    for b in host.get("Binds") or []:
        argv += ["--volume", str(b)]
    for m in ctr.get("Mounts") or []:
        if m.get("Type") == "volume" and m.get("Name"):
            argv += [
                "--volume",
                f"{m['Name']}:{m['Destination']}{'' if m.get('RW', True) else ':ro'}",
            ]
    for d in host.get("Devices") or []:
        argv += ["--device", f"{d['PathOnHost']}:{d.get('PathInContainer') or d['PathOnHost']}"]
    for u in host.get("Ulimits") or []:
        argv += ["--ulimit", f"{u['Name']}={u['Soft']}:{u['Hard']}"]
    if host.get("Memory"):
        argv += ["--memory", str(host["Memory"])]
    if host.get("NanoCpus"):
        argv += ["--cpus", f"{int(host['NanoCpus']) / 1e9:g}"]
    if host.get("PidsLimit"):
        argv += ["--pids-limit", str(host["PidsLimit"])]
    entry = [str(a) for a in cfg.get("Entrypoint") or []]
    if entry:
        argv += ["--entrypoint", entry[0]]
    argv.append(str(ctr["Image"]))
    return argv + entry[1:] + [str(a) for a in cfg.get("Cmd") or []]


async def restore_docker(
    image_url: str,
    *,
    docker: Docker,
    image_settings: ImageSettings,
    state_dir: Path,
    name: str | None = None,
) -> ContainerRestore:
    """Restore the docker container image at ``image_url`` as a new container named ``name``
    (default: the checkpointed container's name)."""
    if name is not None:
        ContainerRef.parse(f"docker:{name}")  # a bad name is refused before any download
    tl = Timeline()
    tmp = await asyncio.to_thread(work_dir, state_dir)
    try:
        with tl.step("pull", image=image_url):
            manifest = await pull_dir(image_url, tmp, settings=image_settings, timeline=tl)
        record = ContainerImage.from_meta(manifest.meta, image_url)
        if record.runtime != "docker" or [f.name for f in manifest.files] != [record.archive]:
            raise ImageError(f"{image_url} is not a docker container image of one archive")
        archive = tmp / record.archive
        if (await asyncio.to_thread(os.stat, archive)).st_size != record.archive_bytes:
            raise ImageError(f"{image_url}: {record.archive} is not of the recorded size")
        ref = ContainerRef.parse(f"docker:{name or record.config.name}")
        key = f"docker:{ref.name}"
        gpu = for_container(docker, ref)
        ours = await _ours(docker, state_dir, image_url, ref)
        if ours is not None:  # a restore stopped before the GPU's part: finish it
            await ctrtemp.remove_copies(lambda: ctrtemp.CriuFiles.of_tar(archive, IMAGES))
            await gpu.thaw(tl, gpu.mapping(record.gpu))
            return ContainerRestore(str(ref), ours, image_url, tl)
        with tl.step("preflight"):
            await preflight(docker, record, ref)
            remap = gpu.mapping(record.gpu)  # other GPUs: refused here, before docker runs
        with tl.step("docker restore"):
            parts = tmp / "parts"
            await asyncio.to_thread(os.makedirs, parts, 0o700)
            await _sh(
                "tar", "-C", str(parts), "--numeric-owner", "-xf", str(archive),
                what=f"unpacking {record.archive}", limit_s=docker.timeout,
            )  # fmt: skip
            data = await asyncio.to_thread((parts / INSPECT).read_bytes)
            ctr = json.loads(data[:MAX_INSPECT_BYTES])
            argv = create_args(ctr, ref.name, docker.runtime_name)
            out = await docker.run(*argv, what=f"creating {ref}")
            cid = out.strip().splitlines()[-1]
            # the intent names the new container's ID before it is started from the checkpoint
            intent = RestoreIntent(image_url=image_url, name=key, id=cid)
            await asyncio.to_thread(intent.save, state_dir)
            try:
                await _fill(docker, ref, parts)
                await _in_place(docker, ref, cid, parts / IMAGES)
            except BaseException:
                await docker.run("rm", "--force", cid, what=f"removing the unfinished {ref}")
                raise
        # its GPU processes come back checkpointed and locked: their memory onto the GPU
        await gpu.restored(
            tl, remap, lambda: docker.run("rm", "--force", ref.name, what=f"removing {ref}")
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ImageError(
            f"{image_url}: docker's record of the container is not understood"
        ) from exc
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    done = RestoreIntent(image_url=image_url, name=key, id=cid, restored=True)
    await asyncio.to_thread(done.save, state_dir)  # the outcome
    log.info("container restored", extra={"image": image_url, "job": str(ref)})
    return ContainerRestore(str(ref), cid, image_url, tl)


async def _ours(docker: Docker, state_dir: Path, image_url: str, ref: ContainerRef) -> str | None:
    """The ID of the container named ``ref`` when an earlier restore of ``image_url`` made
    it (its journal names that ID) and it was started from the checkpoint (it runs, or ran
    and ended): that restore completed, and restoring again would run the job twice. One of
    ours that never started (stopped half-way) is removed by ID so the restore runs again; a
    container the journal does not name is never touched (the preflight refuses it)."""
    intent = await asyncio.to_thread(RestoreIntent.load, state_dir, f"docker:{ref.name}")
    if intent is None or intent.id is None or intent.image_url != image_url:
        return None
    ctr = await docker.inspect(ref.name)
    if ctr is None or ctr.get("Id") != intent.id:
        return None
    if (ctr.get("State") or {}).get("Status") != "created":  # it ran: started from the image
        log.warning(
            "the container an earlier restore of this image made ran; not restoring again",
            extra={"step": "restore", "job": str(ref), "image": image_url},
        )
        if not intent.restored:
            await asyncio.to_thread(intent.model_copy(update={"restored": True}).save, state_dir)
        # CRIU's images the interrupted restore copied in are not needed any more
        left = await docker.root_dir() / "containers" / intent.id / "checkpoints" / CHECKPOINT
        await asyncio.to_thread(shutil.rmtree, left, True)
        return intent.id
    log.warning(
        "an earlier restore of this image left its container unfinished; removing it",
        extra={"step": "restore", "job": str(ref)},
    )
    await docker.run("rm", "--force", intent.id, what=f"removing the unfinished {ref}")
    return None


async def _fill(docker: Docker, ref: ContainerRef, parts: Path) -> None:
    """The writable layer unpacked into the new container's upper dir (it is not mounted:
    the container was created, not started)."""
    new = await docker.inspect(ref.name)
    upper = str((((new or {}).get("GraphDriver") or {}).get("Data") or {}).get("UpperDir") or "")
    if not upper:
        raise ContainerError(f"the new container {ref} has no overlay upper dir (overlay2 needed)")
    await _sh(
        "tar", "-C", upper, *TAR_KEEP, "-xpf", str(parts / LAYER),
        what=f"the writable layer of {ref}", limit_s=docker.timeout,
    )  # fmt: skip


async def preflight(docker: Docker, record: ContainerImage, ref: ContainerRef) -> None:
    """Refuse, before anything is created, what would make the restore fail or differ."""
    if await docker.inspect(ref.name) is not None:
        raise PreflightError(
            f"a container named {ref.name!r} exists on this host: remove it (docker rm) or "
            "restore under another name (--name)"
        )
    cfg = record.config
    if await docker.image_inspect(cfg.image_id) is None:
        named = await docker.image_inspect(cfg.image)
        if named is not None:
            raise MismatchError("container image " + cfg.image, cfg.image_id, named.get("Id"))
        for digest in (d for d in cfg.repo_digests if not d.startswith("localhost/")):
            try:
                await docker.run("pull", "--quiet", digest, what=f"pulling {digest}")
            except SpotguardError as exc:
                log.warning("image pull failed", extra={"image": digest, "error": str(exc)})
        if await docker.image_inspect(cfg.image_id) is None:
            raise PreflightError(
                f"the container's image {cfg.image} ({cfg.image_id[:19]}) is not on this host "
                "and cannot be pulled: load or pull it, then restore again"
            )
    for m in cfg.mounts:
        if m.type == "bind" and not await asyncio.to_thread(os.path.exists, m.source):
            raise MissingMount(
                f"bind mount {m.source} (at {m.destination} in {ref}) does not exist on this "
                "host: bind mounts are the job's data and are not carried in the image; create "
                "or mount it, then restore again"
            )
        if m.type == "volume" and m.name and await docker.inspect_object("volume", m.name) is None:
            raise MissingMount(
                f"volume {m.name} (at {m.destination} in {ref}) does not exist on this host: "
                "volumes are not carried in the image; create it, then restore again"
            )
    for d in cfg.devices:
        if not await asyncio.to_thread(os.path.exists, d.host_path):
            raise MissingMount(f"device {d.host_path} of {ref} is not on this host")
