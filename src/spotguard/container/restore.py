"""Restore a container image from a store into a new podman container.

Nothing the image says is trusted before it is verified, and nothing is created before the
host is checked::

    pull (manifest authenticated, every chunk fetched, BLAKE3-checked and decompressed into a
    private temp dir: a flipped byte stops here) ─► the ContainerImage record (typed) and the
    archive (exactly the one file, of the recorded size) ─► preflight: the name is free, the
    image is here with the same ID (or pulled by digest), every bind mount source, volume and
    device exists; podman's recorded storage paths moved to this host's where they differ
    (archive.py) ─► podman container restore --import (new container, same name) ─► inspect

Bind mounts and volumes are the job's data and are never carried: a missing one is a
:class:`~spotguard.errors.MissingMount` naming it, before podman is called.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from spotguard import safefs
from spotguard.container.archive import relocate
from spotguard.container.checkpoint import work_dir
from spotguard.container.gpu import for_container
from spotguard.container.podman import Podman
from spotguard.container.spec import ContainerImage, ContainerRef
from spotguard.errors import (
    ImageError,
    MismatchError,
    MissingMount,
    PreflightError,
    SpotguardError,
)
from spotguard.image.settings import ImageSettings
from spotguard.image.transfer import pull_dir
from spotguard.statedir import StateDir
from spotguard.timeline import Timeline

log = logging.getLogger(__name__)

MAX_INTENT_BYTES = 4096


@dataclass
class ContainerRestore:
    """What a container restore did."""

    container: str  # podman:NAME
    id: str
    image_url: str
    timeline: Timeline

    def to_json(self) -> dict[str, Any]:
        return {
            "container": self.container,
            "id": self.id,
            "image": self.image_url,
            "timeline": self.timeline.to_list(),
        }


async def restore_container(
    image_url: str,
    *,
    podman: Podman,
    image_settings: ImageSettings,
    state_dir: Path,
    name: str | None = None,
) -> ContainerRestore:
    """Restore the container image at ``image_url`` as a new container named ``name``
    (default: the checkpointed container's name)."""
    if name is not None:
        ContainerRef.parse(f"podman:{name}")  # a bad name is refused before any download
    tl = Timeline()
    tmp = await asyncio.to_thread(work_dir, state_dir)
    try:
        with tl.step("pull", image=image_url):
            manifest = await pull_dir(image_url, tmp, settings=image_settings, timeline=tl)
        record = ContainerImage.from_meta(manifest.meta, image_url)
        archive = _archive(tmp, record, [f.name for f in manifest.files], image_url)
        ref = ContainerRef.parse(f"podman:{name or record.config.name}")
        target = ref.name
        # under its own name podman keeps the checkpointed container's ID: the intent can
        # name the container this restore makes before podman is called
        same_id = target == record.config.name
        expected = record.config.id if same_id else None
        gpu = for_container(podman, ref)
        ours = await _ours(podman, state_dir, image_url, target)
        if ours is not None:  # a restore stopped before the GPU's part: finish it
            await gpu.thaw(tl, gpu.mapping(record.gpu))
            return ContainerRestore(f"podman:{target}", ours, image_url, tl)
        with tl.step("preflight"):
            await preflight(podman, record, target)
            remap = gpu.mapping(record.gpu)  # other GPUs: refused here, before podman runs
            graph_root, run_root = await podman.storage_roots()
            moves = {record.graph_root: graph_root, record.run_root: run_root}
            moved = await asyncio.to_thread(relocate, archive, moves)
            if moved:
                log.info("podman storage paths moved", extra={"what": ", ".join(moved)})
        with tl.step("podman restore"):
            if expected is not None and await _id_taken(podman, expected):
                # the checkpointed container still runs under that ID on this machine (a
                # leave-running checkpoint restored beside it from another storage): runc
                # would refuse the ID, so podman gives a new one (--name)
                log.warning(
                    "the container's ID is in use on this machine; restoring under a new one",
                    extra={"step": "restore", "job": f"podman:{target}", "image": image_url},
                )
                expected = None
            await _podman_restore(podman, state_dir, image_url, archive, target, expected)
        # its GPU processes come back checkpointed and locked: their memory onto the GPU
        await gpu.restored(tl, remap, lambda: _remove(podman, target))
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    ctr = await podman.inspect(target)
    cid = str((ctr or {}).get("Id", ""))
    done = RestoreIntent(image_url=image_url, name=target, id=cid or None, restored=True)
    await asyncio.to_thread(done.save, state_dir)  # the outcome
    log.info("container restored", extra={"image": image_url, "job": f"podman:{target}"})
    return ContainerRestore(f"podman:{target}", cid, image_url, tl)


async def _id_taken(podman: Podman, cid: str) -> bool:
    """Whether runc (as podman runs it, through spotguard's wrapper) knows a container of
    ID ``cid`` on this machine: ``runc state`` answers 0 only for one it knows."""
    await asyncio.to_thread(podman.prepare)
    proc = await asyncio.create_subprocess_exec(
        str(podman.runtime), "state", cid,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL, env=podman.env(),
    )  # fmt: skip
    return await asyncio.wait_for(proc.wait(), podman.timeout) == 0


async def _podman_restore(
    podman: Podman, state_dir: Path, image_url: str, archive: Path, name: str, cid: str | None
) -> None:
    """``podman container restore --import``, its intent journaled first: under the
    checkpointed container's ID ``cid`` (podman keeps it when not renamed), else renamed
    (``--name``: podman gives a new ID, which the intent cannot name)."""
    intent = RestoreIntent(image_url=image_url, name=name, id=cid)
    await asyncio.to_thread(intent.save, state_dir)  # the intent, before podman acts
    await podman.run(
        "container",
        "restore",
        "--import",
        str(archive),
        *(() if cid is not None else ("--name", name)),
        what=f"restoring podman:{name} from {image_url}",
    )


class RestoreIntent(BaseModel):
    """``<state_dir>/containers/restores/<name>.json``: a container restore's journal — the
    intent (image, name, the ID podman will give the container) written before podman is
    called, then the outcome (``restored``). A restorer stopped in between (an agent killed
    mid-restore) finds its own container by that ID when it runs again."""

    model_config = ConfigDict(extra="forbid")

    image_url: str
    name: str  # podman: the container's name; docker:NAME, containerd:NS:ID for the others
    id: str | None  # None: renamed (--name), so podman makes a new ID: not recognisable
    restored: bool = False
    #: Unix time the intent was written (containerd: a container of that ID made earlier is
    #: a stranger's, not this restore's)
    at: float | None = None

    def save(self, state_dir: Path) -> None:
        folder = safefs.ensure_private_dir(StateDir(state_dir).container_restores)
        safefs.write_file(folder / f"{self.name}.json", self.model_dump_json().encode())

    @classmethod
    def load(cls, state_dir: Path, name: str) -> RestoreIntent | None:
        """The journal of the last restore under ``name``; None when there is none or it
        cannot be read (then nothing is taken over: the preflight refuses a name in use)."""
        path = StateDir(state_dir).container_restores / f"{name}.json"
        try:
            return cls.model_validate_json(path.read_bytes()[:MAX_INTENT_BYTES])
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("unreadable restore journal ignored", extra={"error": str(exc)})
            return None


async def _ours(podman: Podman, state_dir: Path, image_url: str, name: str) -> str | None:
    """The ID of the container named ``name`` when an earlier restore of ``image_url`` under
    that name made it (the journal's ID is the container's) and it runs: that restore
    completed, and restoring again would run the job twice. A container of ours that does
    not run (podman stopped mid-restore) is removed — by ID — so the restore runs again; a
    container the journal does not name is never touched (the preflight refuses it)."""
    intent = await asyncio.to_thread(RestoreIntent.load, state_dir, name)
    if intent is None or intent.id is None or intent.image_url != image_url:
        return None
    ctr = await podman.inspect(name)
    if ctr is None or ctr.get("Id") != intent.id:
        return None
    status = str((ctr.get("State") or {}).get("Status") or "")
    if status == "running":
        log.warning(
            "the container an earlier restore of this image made runs; not restoring again",
            extra={"step": "restore", "job": f"podman:{name}", "image": image_url},
        )
        if not intent.restored:
            done = RestoreIntent(image_url=image_url, name=name, id=intent.id, restored=True)
            await asyncio.to_thread(done.save, state_dir)
        return intent.id
    log.warning(
        "an earlier restore of this image left its container unfinished; removing it",
        extra={"step": "restore", "job": f"podman:{name}", "reason": status},
    )
    await _remove(podman, intent.id)
    return None


async def _remove(podman: Podman, name: str) -> None:
    await podman.run("rm", "--force", "--time", "0", name, what=f"removing {name}")


def _archive(tmp: Path, record: ContainerImage, names: list[str], where: str) -> Path:
    """The runtime archive pulled into ``tmp``: the image must hold exactly that one file,
    of the size the record says."""
    if names != [record.archive]:
        raise ImageError(f"{where}: a container image holds {record.archive} only, not {names}")
    path = tmp / record.archive
    size = path.stat().st_size
    if size != record.archive_bytes:
        raise ImageError(
            f"{where}: {record.archive} is {size} bytes, the record says {record.archive_bytes}"
        )
    return path


async def preflight(podman: Podman, record: ContainerImage, name: str) -> None:
    """Refuse, before anything is created, what would make the restore fail or differ."""
    if await podman.exists("container", name):
        raise PreflightError(
            f"a container named {name!r} exists on this host: remove it (podman rm) or restore "
            "under another name (--name)"
        )
    await _image_here(podman, record)
    cfg = record.config
    for m in cfg.mounts:
        if m.type == "bind" and not await asyncio.to_thread(os.path.exists, m.source):
            raise MissingMount(
                f"bind mount {m.source} (at {m.destination} in podman:{cfg.name}) does not "
                "exist on this host: bind mounts are the job's data and are not carried in the "
                "image; create or mount it, then restore again"
            )
        if m.type == "volume" and m.name and not await podman.exists("volume", m.name):
            raise MissingMount(
                f"volume {m.name} (at {m.destination} in podman:{cfg.name}) does not exist on "
                "this host: volumes are not carried in the image; create it, then restore again"
            )
    for d in cfg.devices:
        if not await asyncio.to_thread(os.path.exists, d.host_path):
            raise MissingMount(f"device {d.host_path} of podman:{cfg.name} is not on this host")


async def _image_here(podman: Podman, record: ContainerImage) -> None:
    """The container's image must be here with the recorded ID (the writable layer applies
    to exactly that image); pulled by digest where the reference can be pulled."""
    cfg = record.config
    have = await podman.image_inspect(cfg.image_id)
    if have is not None:
        return
    named = await podman.image_inspect(cfg.image)
    if named is not None:
        raise MismatchError("container image " + cfg.image, cfg.image_id, named.get("Id"))
    pullable = [d for d in cfg.repo_digests if not d.startswith("localhost/")]
    for ref in pullable:
        try:
            await podman.run("pull", "--quiet", ref, what=f"pulling {ref}")
        except SpotguardError as exc:
            log.warning("image pull failed", extra={"image": ref, "error": str(exc)})
            continue
        if await podman.image_inspect(cfg.image_id) is not None:
            return
    tried = f" (pull of {', '.join(pullable)} failed)" if pullable else ""
    raise PreflightError(
        f"the container's image {cfg.image} ({cfg.image_id[:12]}) is not on this host and "
        f"cannot be pulled{tried}: load or pull it, then restore again"
    )
