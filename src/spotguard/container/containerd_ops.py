"""containerd containers (``containerd:NAMESPACE/ID``): start, checkpoint into a store, restore.

Checkpoint (each step timed in the result's timeline)::

    ctr containers info (running? spec, image, runtime, snapshotter) + the image's digest
      ─► the spec blob containerd would refuse to write again moved aside; a second one
         of ctr's own checkpoint images of the container names waited out (:mod:`.ctrspec`)
      ─► image writer opened (an unusable store fails here, before the job stops)
      ─► GPU processes locked and checkpointed (:mod:`.gpu`)
      ─► ctr tasks checkpoint [--exit] (containerd pauses the task; runc dumps it with
         spotguard's CRIU; containerd diffs the writable layer — all while paused; exit
         mode: CRIU ends the processes; once more if CRIU failed: the task ran on)
      ─► leave-running: the task goes on, its GPU processes restored and unlocked
      ─► the OCI layout built from the checkpoint's blobs
         (Containerd.export_layout) ─► image writer (chunks → BLAKE3 → zstd → store, signed
         manifest LAST, the typed ContainerImage record with the host's GPUs in its meta)
         ─► exit mode: the task and container deleted

``ctr containers checkpoint --task`` always resumes the task after the dump (in exit mode the
job would run on until its removal: its output written twice after a restore); ``ctr tasks
checkpoint --exit`` ends it at the dump, but its image lacks what ``ctr containers restore``
reads (runtime options, the annotations naming image, runtime and snapshotter), which the
layout adds. ``ctr images export`` of a checkpoint image fails on containerd 1.6 (``invalid
character '\\x1a'``): the layout is written from ``ctr content get`` of each blob instead.

Restore: pull (verified) ─► the record ─► preflight (the ID is free in the namespace, the image
is there with the recorded digest, every bind mount source and device exists, the image's GPUs
map onto this host's) ─► ``ctr images import --no-unpack`` of the layout ─► ``ctr containers
restore --rw --live`` (a new container of the same image and ID: the writable layer applied,
the task restored by runc with spotguard's CRIU) ─► the checkpoint image and containerd's copy
(:mod:`.ctrtemp`) removed ─► the task's GPU processes restored (onto the mapped GPUs), unlocked.

Exit mode: a failure before the image is durable restores the container in place from the
layout (the same import and restore), so a failed checkpoint never leaves the job stopped;
in either mode a failure after the GPU freeze restores and unlocks the GPU processes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from spotguard.container import ctrspec, ctrtemp
from spotguard.container.checkpoint import ContainerCheckpoint, work_dir
from spotguard.container.containerd import CRIU_CONFIG_ANNOTATION, Containerd, layout_name
from spotguard.container.gpu import for_container
from spotguard.container.restore import ContainerRestore, RestoreIntent
from spotguard.container.spec import (
    CONTAINERD_ARCHIVE,
    ContainerConfig,
    ContainerImage,
    ContainerRef,
    Device,
    Mount,
    Ulimit,
)
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


async def start_containerd(
    ref: ContainerRef,
    image: str,
    args: Sequence[str],
    *,
    ctrd: Containerd,
    volumes: Sequence[str] = (),
    env: Sequence[str] = (),
    devices: Sequence[str] = (),
    network: str = "none",
) -> str:
    """Start ``image`` with ``args`` as the detached container ``ref`` (``ctr run -d``, its
    stdio to /dev/null, spotguard's runc wrapper, its own network namespace with loopback
    only unless ``network`` is ``host``); its ID."""
    if await ctrd.exists(ref):
        raise JobError(f"a container {ref} already exists (ctr -n {ref.namespace} c rm it first)")
    argv = ["run", "--detach", "--null-io", "--runc-binary", str(ctrd.runtime)]
    argv += ["--annotation", f"{CRIU_CONFIG_ANNOTATION}={ctrd.runtime_dir / 'criu.conf'}"]
    if network == "host":
        argv.append("--net-host")
    elif network != "none":
        raise ConfigError(f"--network {network!r}: a containerd container takes none or host")
    for v in volumes:
        src, _, rest = v.partition(":")
        dst, _, opt = rest.partition(":")
        opts = set(opt.split(",")) - {""}  # podman's: ro or rw, bind (this mount only) or rbind
        if (
            not src.startswith("/") or not dst.startswith("/")
            or not opts <= {"rw", "ro", "bind", "rbind"} or {"rw", "ro"} <= opts
            or {"bind", "rbind"} <= opts
        ):  # fmt: skip
            raise ConfigError(f"--volume {v!r}: use /HOST/PATH:/CONTAINER/PATH[:ro][,bind]")
        how = f"{'bind' if 'bind' in opts else 'rbind'}:{'ro' if 'ro' in opts else 'rw'}"
        argv += ["--mount", f"type=bind,src={src},dst={dst},options={how}"]
    for e in env:
        argv += ["--env", e]
    for d in devices:
        argv += ["--device", d]
    await ctrd.run(*argv, image, ref.name, *args, namespace=ref.namespace, what=f"starting {ref}")
    return ref.name


async def inspect_running(ctrd: Containerd, ref: ContainerRef) -> tuple[dict[str, Any], str]:
    """The container's info and its image's digest; JobNotFound when there is no such
    container, JobError when its task does not run."""
    info = await ctrd.info(ref)
    if info is None:
        raise JobNotFound(f"no containerd container {ref} on this host")
    status, _ = await ctrd.task(ref)
    if status != "RUNNING":
        said = status.lower() or "without a task"
        raise JobError(f"container {ref} is {said}, not running: nothing to checkpoint")
    image = str(info.get("Image") or "")
    digest = (await ctrd.images(ref.namespace)).get(image, "")
    if not digest:
        raise JobError(f"the image {image!r} of {ref} is not in containerd's image store")
    return info, digest


async def checkpoint_containerd(
    ref: ContainerRef,
    store_url: str,
    *,
    ctrd: Containerd,
    image_settings: ImageSettings,
    state_dir: Path,
    leave_running: bool = False,
    tcp_established: bool = False,
    meta: dict[str, Any] | None = None,
    on_frozen: Callable[[float], None] | None = None,
) -> ContainerCheckpoint:
    """Checkpoint the running containerd container ``ref`` into a new image of ``ref.job``
    in the store at ``store_url`` (exit mode: the container is removed once the image is
    durable); as :func:`~spotguard.container.checkpoint.checkpoint_container` for podman."""
    if tcp_established:
        raise ConfigError(
            "--tcp-established is not supported for containerd containers (ctr tasks "
            "checkpoint has no such option): docs/limits.md"
        )
    tl = Timeline()
    mode = Mode.RESUME if leave_running else Mode.EXIT
    with tl.step("inspect"):
        info, digest = await inspect_running(ctrd, ref)
        config = config_of(info, digest)
        version = await ctrd.version()
        # what containerd would fail on after the dump: a spec blob (aside), an image name
        held, names = await asyncio.gather(
            ctrspec.clear_spec(ctrd, ref, state_dir), ctrspec.checkpoint_images(ctrd, ref)
        )
        await ctrspec.wait_for_a_free_name(ref, names)  # before the stop, not in it
    tmp = await asyncio.to_thread(work_dir, state_dir)
    layout = tmp / CONTAINERD_ARCHIVE
    name = f"spotguard.local/checkpoint/{ref.job}:{int(time.time() * 1000)}"
    taken = ""
    writer = ImageWriter(store_url, ref.job, settings=image_settings, timeline=tl)
    gpu = for_container(ctrd, ref)
    try:
        async with writer:  # first: a store that cannot take the image fails before the stop
            with tl.step("ctr checkpoint", mode=mode, streamed=False) as dump:
                await gpu.freeze(tl)  # GPU memory into the processes' host memory first
                out = await ctrd.checkpoint_task(ref, leave_running=leave_running)
                taken = out.strip().splitlines()[-1] if out.strip() else ""
            frozen_at = time.time()
            pause_s: float | None = None
            if leave_running:  # the task went on (same processes): back onto the GPU
                if not gpu.already:  # a container parked in memory stays off the GPU
                    await gpu.thaw(tl)
                pause_s = time.time() - dump.start
            if on_frozen is not None:
                on_frozen(frozen_at)
            with tl.step("layout"):
                await ctrd.export_layout(ref, taken, info, layout, name)
            with tl.step("push", image=writer.url):
                size = (await writer.add_file(layout, CONTAINERD_ARCHIVE)).size
                record = ContainerImage(
                    runtime="containerd", runtime_version=version,
                    criu_version=ctrd.criu_version(), mode=mode, archive=CONTAINERD_ARCHIVE,
                    archive_bytes=size, config=config, namespace=ref.namespace,
                    oci_runtime=str((info.get("Runtime") or {}).get("Name") or ""),
                    snapshotter=str(info.get("Snapshotter") or ""), gpu=gpu.record(),
                )  # fmt: skip
                await writer.commit({**(meta or {}), **record.to_meta()})
        durable_at = time.time()
    except BaseException:
        if not leave_running:  # exit mode: a failed checkpoint never leaves the job stopped
            await _bring_back(ctrd, ref, info, taken, layout, name)
        if gpu.frozen:  # ... nor its GPU processes checkpointed or locked
            await gpu.thaw_quietly(tl)
        raise
    finally:
        if taken:
            await ctrd.remove_image(ref.namespace, taken)
        await ctrspec.put_back(ctrd, ref.namespace, held)
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    log.info("container checkpointed", extra={"job": ref.job, "image": writer.url, "mode": mode})
    if not leave_running:
        with tl.step("remove"):
            await _remove(ctrd, ref)
    return ContainerCheckpoint(
        container=str(ref), job=ref.job, image_url=writer.url, mode=mode,
        bytes=record.archive_bytes, stored_bytes=writer.stats.stored_bytes, timeline=tl,
        stats=writer.stats, frozen_at=frozen_at, freeze_seconds=frozen_at - dump.start,
        pause_seconds=pause_s, durable_at=durable_at, streamed=False,
    )  # fmt: skip


async def _remove(ctrd: Containerd, ref: ContainerRef) -> None:
    """Delete the container's (stopped) task, then the container and its snapshot."""
    what = f"removing {ref} (image durable)"
    if (await ctrd.task(ref))[0]:
        await ctrd.run("tasks", "delete", ref.name, namespace=ref.namespace, what=what)
    await ctrd.run("containers", "delete", ref.name, namespace=ref.namespace, what=what)


async def _discard(ctrd: Containerd, ref: ContainerRef) -> None:
    """Kill and delete a restored container that cannot run (its GPU state did not come back)."""
    what = f"removing {ref} (its GPU state did not come back)"
    if (await ctrd.task(ref))[0]:
        await ctrd.run("tasks", "delete", "--force", ref.name, namespace=ref.namespace, what=what)
    await ctrd.run("containers", "delete", ref.name, namespace=ref.namespace, what=what)


async def _bring_back(
    ctrd: Containerd, ref: ContainerRef, info: dict[str, Any], taken: str, layout: Path, name: str
) -> None:
    """Exit mode, the image not durable: restore the container in place from its checkpoint
    unless it still runs (the checkpoint failed before CRIU ended it); logged, never raised
    over the error that brought us here."""
    try:
        if (await ctrd.task(ref))[0] == "RUNNING":
            return
        if not taken:
            raise ContainerError(f"no checkpoint of {ref} was taken")
        await ctrd.export_layout(ref, taken, info, layout, name)  # anew: it may be partial
        await _remove(ctrd, ref)
        await _restore(ctrd, ref, layout)
        log.warning("container restored in place after a failed checkpoint", extra={"job": ref.job})
    except SpotguardError as exc:
        log.error(
            "container could not be brought back after a failed checkpoint",
            extra={"job": ref.job, "error": str(exc)},
        )


async def _restore(ctrd: Containerd, ref: ContainerRef, layout: Path) -> None:
    """Import the layout, restore the container from it, remove the checkpoint image."""
    ns = ref.namespace
    checkpoint = await ctrd.import_layout(ns, layout)
    try:  # containerd's own copy of the checkpoint removed after (ctrtemp)
        async with ctrtemp.removing_leftovers(lambda: ctrtemp.CriuFiles.of_layout(layout)):
            await ctrd.run(
                "containers", "restore", "--rw", "--live", ref.name, checkpoint,
                namespace=ns, what=f"restoring {ref}",
            )  # fmt: skip
    finally:
        await ctrd.remove_image(ns, checkpoint)


async def restore_containerd(
    image_url: str,
    *,
    ctrd: Containerd,
    image_settings: ImageSettings,
    state_dir: Path,
    name: str | None = None,
) -> ContainerRestore:
    """Restore the containerd container image at ``image_url`` as a new container of the
    same namespace and ID (``name``: another ID)."""
    tl = Timeline()
    tmp = await asyncio.to_thread(work_dir, state_dir)
    try:
        with tl.step("pull", image=image_url):
            manifest = await pull_dir(image_url, tmp, settings=image_settings, timeline=tl)
        record = ContainerImage.from_meta(manifest.meta, image_url)
        if record.runtime != "containerd":
            raise ImageError(f"{image_url} holds a {record.runtime} container, not containerd's")
        names = [f.name for f in manifest.files]
        if names != [record.archive]:
            raise ImageError(f"{image_url}: a container image holds {record.archive} only")
        layout = tmp / record.archive
        if (await asyncio.to_thread(os.stat, layout)).st_size != record.archive_bytes:
            raise ImageError(f"{image_url}: {record.archive} is not of the recorded size")
        ref = ContainerRef.parse(f"containerd:{record.namespace}/{name or record.config.name}")
        gpu = for_container(ctrd, ref)
        if await _ours(ctrd, state_dir, image_url, ref):  # the checkpoint image may be left
            await ctrd.remove_image(ref.namespace, await asyncio.to_thread(layout_name, layout))
            await ctrtemp.remove_copies(lambda: ctrtemp.CriuFiles.of_layout(layout))  # and its copy
            await gpu.thaw(tl, gpu.mapping(record.gpu))  # stopped before the GPU's part?
            return ContainerRestore(str(ref), ref.name, image_url, tl)
        with tl.step("preflight"):
            await preflight(ctrd, record, ref)
            remap = gpu.mapping(record.gpu)  # other GPUs: refused here, before ctr runs
        with tl.step("ctr restore"):
            intent = RestoreIntent(image_url=image_url, name=journal_key(ref), id=ref.name)
            await asyncio.to_thread(intent.model_copy(update={"at": time.time()}).save, state_dir)
            await _restore(ctrd, ref, layout)
        # its GPU processes come back checkpointed and locked: their memory onto the GPU
        await gpu.restored(tl, remap, lambda: _discard(ctrd, ref))
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    done = RestoreIntent(image_url=image_url, name=journal_key(ref), id=ref.name, restored=True)
    await asyncio.to_thread(done.save, state_dir)  # the outcome
    log.info("container restored", extra={"image": image_url, "job": str(ref)})
    return ContainerRestore(str(ref), ref.name, image_url, tl)


def journal_key(ref: ContainerRef) -> str:
    """The restore journal's name for a containerd container (``:`` is in no podman name)."""
    return f"containerd:{ref.namespace}:{ref.name}"


async def _ours(ctrd: Containerd, state_dir: Path, image_url: str, ref: ContainerRef) -> bool:
    """Whether the container ``ref`` is one an earlier restore of ``image_url`` made (its
    journal's intent is older than the container) whose task was restored (it runs, or ran
    and ended): that restore completed, and restoring again would run the job twice. One of
    ours without a restored task (ctr stopped half-way) is removed so the restore runs again;
    a container made before the intent is never touched (the preflight refuses it)."""
    intent = await asyncio.to_thread(RestoreIntent.load, state_dir, journal_key(ref))
    if intent is None or intent.image_url != image_url or intent.at is None:
        return False
    info = await ctrd.info(ref)
    if info is None:
        return False
    try:
        created = datetime.fromisoformat(str(info.get("CreatedAt"))).timestamp()
    except ValueError:
        return False
    if created < intent.at - 1.0:
        return False
    status = (await ctrd.task(ref))[0]
    if status in ("RUNNING", "PAUSED", "PAUSING", "STOPPED"):  # restored: it runs or ran
        log.warning(
            "the container an earlier restore of this image made ran; not restoring again",
            extra={"step": "restore", "job": str(ref), "image": image_url},
        )
        if not intent.restored:
            await asyncio.to_thread(intent.model_copy(update={"restored": True}).save, state_dir)
        return True
    log.warning(
        "an earlier restore of this image left its container unfinished; removing it",
        extra={"step": "restore", "job": str(ref)},
    )
    if status:
        what = f"removing the unfinished {ref}"
        await ctrd.run("tasks", "delete", "--force", ref.name, namespace=ref.namespace, what=what)
    await ctrd.run("containers", "delete", ref.name, namespace=ref.namespace, what="removing")
    return False


def pull_reference(image: str, digest: str) -> str | None:
    """``NAME@DIGEST`` to pull the exact image a container ran (``image``: its recorded
    ``NAME[:TAG]``; ``digest``: its target), or None where no registry can serve it: a
    ``localhost/`` name or one without a registry host (containerd wants fully qualified
    references)."""
    name = image.split("@", 1)[0]
    slash, colon = name.rfind("/"), name.rfind(":")
    if colon > slash:
        name = name[:colon]  # the tag: the digest names the image
    host = name.split("/", 1)[0] if "/" in name else ""
    if not host or host == "localhost" or not ("." in host or ":" in host):
        return None
    if not digest.startswith("sha256:"):
        return None
    return f"{name}@{digest}"


async def preflight(ctrd: Containerd, record: ContainerImage, ref: ContainerRef) -> None:
    """Refuse, before anything is created, what would make the restore fail or differ."""
    if await ctrd.exists(ref):
        raise PreflightError(
            f"a container {ref} exists on this host: remove it (ctr -n {ref.namespace} c rm "
            f"{ref.name}) or restore under another ID (--name)"
        )
    cfg = record.config
    have = (await ctrd.images(ref.namespace)).get(cfg.image)
    tried = ""
    if have is None and (pullable := pull_reference(cfg.image, cfg.image_id)) is not None:
        tried = f" (pull of {pullable} failed)"
        try:
            await ctrd.run(
                "images", "pull", *ctrd.registry_args(), pullable,
                namespace=ref.namespace, what="pulling",
            )  # fmt: skip
            await ctrd.run(
                "images", "tag", "--force", pullable, cfg.image,
                namespace=ref.namespace, what="naming the pulled image",
            )  # fmt: skip
        except SpotguardError as exc:
            log.warning("image pull failed", extra={"image": pullable, "error": str(exc)})
        have = (await ctrd.images(ref.namespace)).get(cfg.image)
    if have is None:
        raise PreflightError(
            f"the container's image {cfg.image} ({cfg.image_id[:19]}) is not in containerd "
            f"namespace {ref.namespace} on this host and cannot be pulled{tried}: import or "
            f"pull it (ctr -n {ref.namespace} images import/pull), then restore again"
        )
    if have != cfg.image_id:
        raise MismatchError("container image " + cfg.image, cfg.image_id, have)
    for m in cfg.mounts:
        if m.source and not await asyncio.to_thread(os.path.exists, m.source):
            raise MissingMount(
                f"bind mount {m.source} (at {m.destination} in {record.ref}) does not exist on "
                "this host: bind mounts are the job's data and are not carried in the image; "
                "create or mount it, then restore again"
            )
    for d in cfg.devices:
        if not await asyncio.to_thread(os.path.exists, d.host_path):
            raise MissingMount(f"device {d.host_path} of {record.ref} is not on this host")


def spec_of(info: dict[str, Any]) -> dict[str, Any]:
    """The container's OCI spec from ``ctr containers info`` (its ``Spec``; older ctr gave
    the protobuf ``Any`` with the JSON base64-encoded in ``value``)."""
    spec = info.get("Spec")
    if isinstance(spec, dict) and "value" in spec and "ociVersion" not in spec:
        try:
            spec = json.loads(base64.b64decode(str(spec["value"])))
        except ValueError as exc:
            raise ContainerError("the container's spec is not understood") from exc
    if not isinstance(spec, dict):
        raise ContainerError("ctr containers info names no spec")
    return spec


def config_of(info: dict[str, Any], digest: str) -> ContainerConfig:
    """The container's record from ``ctr containers info`` (its OCI spec) and its image's
    digest: what restore checks on the target host."""
    spec = spec_of(info)
    process = spec.get("process") or {}
    linux = spec.get("linux") or {}
    res = linux.get("resources") or {}
    cpu = res.get("cpu") or {}
    quota, period = int(cpu.get("quota") or 0), int(cpu.get("period") or 0)
    namespaces = {
        str(n.get("type")): str(n.get("path") or "") for n in linux.get("namespaces") or []
    }
    if "network" not in namespaces:
        network = "host"
    else:
        network = f"ns:{namespaces['network']}" if namespaces["network"] else "none"
    try:
        return ContainerConfig(
            name=str(info["ID"]),
            id=str(info["ID"]),
            image=str(info.get("Image") or ""),
            image_id=digest,
            command=[str(a) for a in process.get("args") or []],
            env=[str(e) for e in process.get("env") or []],
            mounts=[
                Mount(
                    type="bind",
                    destination=str(m["destination"]),
                    source=str(m.get("source") or ""),
                    rw="ro" not in (m.get("options") or []),
                )
                for m in spec.get("mounts") or []
                if m.get("type") == "bind" or {"bind", "rbind"} & set(m.get("options") or [])
            ],
            devices=[
                Device(host_path=str(d["path"]), container_path=str(d["path"]))
                for d in linux.get("devices") or []
            ],
            network_mode=network,
            memory=int((res.get("memory") or {}).get("limit") or 0),
            nano_cpus=quota * 1_000_000_000 // period if quota > 0 and period > 0 else 0,
            pids_limit=int((res.get("pids") or {}).get("limit") or 0),
            ulimits=[
                Ulimit(name=str(r["type"]), soft=int(r["soft"]), hard=int(r["hard"]))
                for r in process.get("rlimits") or []
            ],
            annotations={str(k): str(v) for k, v in (spec.get("annotations") or {}).items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise JobError(f"containerd's container info is not understood: {str(exc)[:200]}") from exc
