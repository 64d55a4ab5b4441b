"""Keep containerd's own checkpoint from failing on something it already holds.

At every ``ctr tasks checkpoint`` containerd writes the container's runtime spec into its
content store (a protobuf ``Any`` holding the spec's JSON), and its task service fails the
whole checkpoint when a blob of that digest is already there ("content sha256:…: already
exists") — **after** the runtime's dump: with ``--exit`` the task has ended and CRIU's files
are deleted, so the job would be lost. The spec of a container does not change, so every
checkpoint of the same container writes the same blob: it is already there while another
checkpoint image of the container exists (one the user made with ``ctr``), and for a moment
after one is removed (containerd collects removed content later, on its own schedule).

So before the checkpoint, :func:`clear_spec` computes that blob's digest (containerd's exact
encoding: the spec's JSON as ``ctr containers info --spec`` prints it, compacted, in an
``Any`` of the runtime-spec type) and, when the content store holds it, reads it and deletes
it; :func:`put_back` writes the same bytes back after the checkpoint if another image still
names it and the checkpoint did not write it again. A blob another image names is first kept
in the state dir (``containers/held-specs/PID-START-DIGEST``): a spotguard killed before its
put-back leaves it there, and :func:`recover_held` (the agent as it starts guarding a
containerd container, every containerd checkpoint) writes back those whose process is gone.
No library speaks containerd's content API from Python; ``ctr`` does, and the encoding is
two protobuf fields.

The image fails the same way: ``ctr tasks checkpoint`` (which has no option to name it) names
it ``containerd.io/checkpoint/<container>:<the second it started>`` and fails creating it,
again after the dump, when an image of that name exists — a user's checkpoint of the
container in the same second. :func:`checkpoint_images` lists those names before the stop;
:func:`wait_for_a_free_name` waits out a second they name — before the stop: a name of a second
already past cannot be the one ``ctr`` gives, however long the GPU freeze before it takes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from spotguard import safefs
from spotguard.checkpoint.procfacts import same_process, start_time
from spotguard.container.containerd import Containerd
from spotguard.container.spec import ContainerRef
from spotguard.errors import ContainerError, UnsafePath
from spotguard.statedir import StateDir

log = logging.getLogger(__name__)

#: the type URL containerd gives a runtime spec
SPEC_TYPE = b"types.containerd.io/opencontainers/runtime-spec/1/Spec"
#: a spec blob is a few kilobytes; a larger one is not what this module looks for
SPEC_LIMIT = 1 << 20
#: how ``ctr tasks checkpoint`` names its image: the container, then the second (Go's
#: ``01-02-2006-15:04:05`` in the local zone)
CHECKPOINT_NAME = "containerd.io/checkpoint/{container}:{second}"
#: the longest wait for a free name: past it, the checkpoint goes ahead (what it did before)
NAME_WAIT_S = 10.0
#: a held blob's file: its owner's pid and start time, then the digest's hex
_HELD = re.compile(r"^(\d+)-(\d+)-([0-9a-f]{64})$")


@dataclass(frozen=True)
class HeldSpec:
    """A spec blob moved out of the way of a checkpoint: its digest, bytes, whether other
    content names it (an image's index: then it must come back) and, then, the file that
    keeps its bytes until it is back."""

    digest: str
    data: bytes
    named: bool
    kept: Path | None = None


def compact_json(text: str) -> bytes:
    """``text`` (JSON as Go's ``MarshalIndent`` writes it) without the whitespace outside
    strings: what Go's ``Marshal`` wrote in the first place, escapes and key order kept."""
    out: list[str] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            out.append(ch)
        elif ch not in " \t\r\n":
            out.append(ch)
    return "".join(out).encode()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def spec_blob(spec_json: str) -> bytes:
    """The blob containerd writes for a container whose spec prints as ``spec_json``: a
    protobuf ``Any`` (field 1 the type URL, field 2 the compact JSON)."""
    value = compact_json(spec_json)
    return b"\x0a" + _varint(len(SPEC_TYPE)) + SPEC_TYPE + b"\x12" + _varint(len(value)) + value


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


async def _content(ctrd: Containerd, namespace: str) -> dict[str, str]:
    """The namespace's blobs: digest → its labels column (``ctr content ls``)."""
    out = await ctrd.run("content", "ls", namespace=namespace, what="listing content")
    found: dict[str, str] = {}
    for line in out.splitlines()[1:]:
        cols = line.split()
        if cols and cols[0].startswith("sha256:"):
            found[cols[0]] = cols[-1]
    return found


def _named(content: dict[str, str], digest: str) -> bool:
    return any(d != digest and f"={digest}" in labels for d, labels in content.items())


async def clear_spec(ctrd: Containerd, ref: ContainerRef, state_dir: Path) -> HeldSpec | None:
    """Delete the blob the checkpoint of ``ref`` would fail on, if the content store holds
    it; what :func:`put_back` needs to restore it (a blob another image names kept under
    ``state_dir`` first). Blobs a killed spotguard held are written back first
    (:func:`recover_held`). Anything unexpected (no spec, a ctr failure) leaves the store as
    it is and returns None: the checkpoint is then no worse off than without this step."""
    ns = ref.namespace
    await recover_held(ctrd, state_dir)
    try:
        spec = await ctrd.run(
            "containers", "info", "--spec", ref.name, namespace=ns, what=f"reading {ref}'s spec"
        )
        digest = digest_of(spec_blob(spec))
        content = await _content(ctrd, ns)
        if digest not in content:
            return None
        data = await ctrd.read_blob(ns, digest, SPEC_LIMIT)
        if digest_of(data) != digest:
            return None
        held = HeldSpec(digest, data, _named(content, digest))
        if held.named:  # its bytes safe before the store loses them
            held = await asyncio.to_thread(_keep, state_dir, ns, held)
        await ctrd.run("content", "rm", digest, namespace=ns, what="moving a spec blob aside")
    except ContainerError as exc:
        log.warning("spec blob not checked", extra={"job": ref.job, "error": str(exc)})
        return None
    log.info(
        "spec blob moved aside for the checkpoint",
        extra={"job": ref.job, "chunk": digest, "what": "named" if held.named else "unnamed"},
    )
    return held


async def put_back(ctrd: Containerd, namespace: str, held: HeldSpec | None) -> None:
    """Write a moved blob back if other content still names it and it is not there (the
    checkpoint failed before writing it, or its image was removed and collected). Logged,
    never raised: the checkpoint's outcome is what the caller reports."""
    if held is None or not held.named:
        return
    try:
        content = await _content(ctrd, namespace)
        if held.digest not in content and _named(content, held.digest):
            await asyncio.to_thread(_ingest, ctrd, namespace, held)
            log.info("spec blob put back", extra={"chunk": held.digest})
    except (ContainerError, OSError, subprocess.SubprocessError) as exc:
        log.error(  # its kept copy stays: the agent's next start writes it back
            "spec blob not put back",
            extra={"chunk": held.digest, "error": str(exc)},
        )
        return
    if held.kept is not None:
        held.kept.unlink(missing_ok=True)


def _keep(state_dir: Path, namespace: str, held: HeldSpec) -> HeldSpec:
    """Write ``held``'s namespace and bytes under the state dir, named after this process.
    Where that fails (a full or read-only state dir) the blob is still moved aside, its bytes
    only in memory: a checkpoint failing on it would lose the job, a worse loss."""
    base = StateDir(state_dir).held_specs
    path = base / f"{os.getpid()}-{start_time('self') or 0}-{held.digest[7:]}"
    try:
        safefs.ensure_private_dir(base)
        safefs.write_file(path, namespace.encode() + b"\n" + held.data, mode=0o600)
    except (OSError, UnsafePath) as exc:
        log.warning("spec blob kept in memory only", extra={"path": str(path), "error": str(exc)})
        return held
    return HeldSpec(held.digest, held.data, held.named, path)


def _orphans(state_dir: Path) -> list[tuple[str, HeldSpec]]:
    """The held blobs whose spotguard is gone: (namespace, blob) for each."""
    base = StateDir(state_dir).held_specs
    found: list[tuple[str, HeldSpec]] = []
    for path in sorted(base.iterdir()) if base.is_dir() else []:
        m = _HELD.match(path.name)
        if m is None or same_process(int(m[1]), int(m[2])):
            continue  # not one of these, or its checkpoint still runs
        namespace, _, data = path.read_bytes().partition(b"\n")
        digest = "sha256:" + m[3]
        if digest_of(data) != digest:  # cut short while written: the store still has it
            path.unlink(missing_ok=True)
            continue
        found.append((namespace.decode(), HeldSpec(digest, data, True, path)))
    return found


async def recover_held(ctrd: Containerd, state_dir: Path) -> list[str]:
    """Write back every spec blob a killed spotguard moved aside and kept (where an image
    still names it and the store lacks it); the digests handled. Never raises."""
    try:
        orphans = await asyncio.to_thread(_orphans, state_dir)
    except OSError as exc:
        log.error("held spec blobs not read", extra={"error": str(exc)})
        return []
    for namespace, held in orphans:
        log.warning(
            "spec blob held by a killed checkpoint",
            extra={"chunk": held.digest, "path": str(held.kept)},
        )
        await put_back(ctrd, namespace, held)
    return [held.digest for _, held in orphans]


def _ingest(ctrd: Containerd, namespace: str, held: HeldSpec) -> None:
    """``ctr content ingest`` of the held bytes, checked against their digest and size. Its
    input is a file, not a pipe: where the blob was removed but not yet collected, containerd
    answers the write as already ``size`` bytes in, and ctr seeks its input there before it
    commits (a pipe cannot seek: "unable to resume write ... illegal seek")."""
    argv = ctrd.argv(
        namespace, "content", "ingest", "--expected-digest", held.digest,
        "--expected-size", str(len(held.data)), f"spotguard-spec-{held.digest[7:19]}",
    )  # fmt: skip
    with tempfile.TemporaryFile() as data:
        data.write(held.data)
        data.seek(0)
        done = subprocess.run(
            argv, stdin=data, capture_output=True, env=ctrd.env(), timeout=ctrd.timeout
        )
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip()[-300:]
        raise ContainerError(f"ctr content ingest {held.digest} failed: {said}")


def _names_at(container: str, at: float) -> set[str]:
    """The image name a checkpoint of ``container`` started at ``at`` gets (in the local
    zone, and in UTC in case ``ctr`` runs without the host's zone)."""
    return {
        CHECKPOINT_NAME.format(
            container=container, second=time.strftime("%m-%d-%Y-%H:%M:%S", t(at))
        )
        for t in (time.localtime, time.gmtime)
    }


async def checkpoint_images(ctrd: Containerd, ref: ContainerRef) -> frozenset[str]:
    """The names of ``ctr``'s own checkpoint images of ``ref`` (the user's); empty when they
    cannot be listed (the checkpoint is then no worse off than without the check)."""
    prefix = CHECKPOINT_NAME.format(container=ref.name, second="")
    try:
        names = await ctrd.images(ref.namespace)
    except ContainerError as exc:
        log.warning("checkpoint images not listed", extra={"job": ref.job, "error": str(exc)})
        return frozenset()
    return frozenset(n for n in names if n.startswith(prefix))


async def wait_for_a_free_name(ref: ContainerRef, taken: frozenset[str]) -> float:
    """Wait, at most :data:`NAME_WAIT_S`, until neither this second nor the next (``ctr``
    names the image when it starts, a moment from now) gives a checkpoint of ``ref`` a name
    in ``taken``; the seconds waited. Called before the job is stopped: ``ctr`` starts later
    still, in a second no existing image names."""
    if not taken:
        return 0.0
    start = time.time()
    while (now := time.time()) - start < NAME_WAIT_S:
        if not (taken & (_names_at(ref.name, now) | _names_at(ref.name, now + 1))):
            break
        await asyncio.sleep(1.0 - now % 1.0 + 0.02)  # past this second
    waited = time.time() - start
    if waited > 0.01:
        log.info(
            "checkpoint waited for a free image name",
            extra={"job": ref.job, "seconds": round(waited, 3)},
        )
    return waited
