"""The host mounts of a job's mount namespace: which ones the job uses, and what restore
binds at each.

A ``spotguard run`` job has its own mount namespace, a copy of the host's made when it
started (:mod:`.jobinit`): every mount the host had then is in it, most of them nothing to do
with the job (another container's overlay, an operator's bind mount). CRIU records each as
an *external* mount and, at restore, binds it again from a path of the restoring host; left
to its own detection (``--external mnt[]``) it names that path itself, and a path the
restoring host lacks fails the whole restore ("mnt-v2: Failed to open_tree … No such file",
"Can't stat mountpoint"), whether the job used the mount or not.

So spotguard names them (:func:`survey`, before the dump): each mount of the job's namespace
that is one of the host's (same device, its root within the host mount's) is given to CRIU
as ``--external mnt[MOUNTPOINT]:KEY`` with a key of ours, and the image's metadata records
the key, the mountpoint, the host path it comes from and whether it is a directory. While
the tree is frozen (:func:`mark_used`), the mounts the job *uses* are marked: those holding
its open files, its mapped files, its working and root directories, and every mount they sit
on. At restore (:func:`plan`): a mount whose host path and mountpoint exist here is bound
from that path, as before. A mount is absent when its host path does not exist, when that
path was a mountpoint and nothing is mounted there now, or when its mountpoint does not
exist. A used one that is absent refuses the restore in its preflight (:func:`check`,
:class:`~spotguard.errors.MissingMount` naming it), before any file is written or process
created. An unused one that is absent comes back empty (an empty directory or file of ours),
with one log line naming it; a mountpoint the host lacks is made for the restore and removed
right after (which detaches the empty mount from the job's namespace: "left out"), never on
the host where the mount sits on another unused one (that one comes back empty too, with
the mountpoint made in our stand-in).

Mounts the job made itself (its own ``/proc``, a tmpfs) are not the host's, and mounts that
share propagation with the host (none in a ``spotguard run`` job: its init makes every mount
private) are left to CRIU's own detection, as before. So is every mount of an image without
mount records (older ones).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard.errors import MissingMount, PreflightError

log = logging.getLogger(__name__)

KEY_PREFIX = "sg-mnt-"


@dataclass(frozen=True)
class MountLine:
    """One line of ``/proc/PID/mountinfo``."""

    id: int
    parent: int
    dev: str  # major:minor
    root: str
    mountpoint: str
    fstype: str
    propagation: tuple[str, ...] = ()  #: mountinfo's optional fields (shared:N, master:N)


@dataclass(frozen=True)
class JobMount:
    """A host mount in the job's namespace, as the image records it."""

    key: str  #: CRIU's name for it in the image (``--external mnt[KEY]:PATH`` at restore)
    mountpoint: str  #: where the job sees it
    source: str  #: the host path it was bound from (the mount's content on the dump host)
    parent: str  #: the mountpoint of the mount it sits on ("/": the namespace's root)
    is_dir: bool
    used: bool = False
    fstype: str = ""
    #: ``source`` was a mountpoint of the dump host: the restoring host needs a mount there
    #: too (a bare directory at that path is the mount's absence, not the mount)
    source_is_mount: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "mountpoint": self.mountpoint,
            "source": self.source,
            "parent": self.parent,
            "is_dir": self.is_dir,
            "used": self.used,
            "fstype": self.fstype,
            "source_is_mount": self.source_is_mount,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> JobMount:
        m = cls(
            key=str(d["key"]),
            mountpoint=str(d["mountpoint"]),
            source=str(d["source"]),
            parent=str(d["parent"]),
            is_dir=bool(d["is_dir"]),
            used=bool(d.get("used", False)),
            fstype=str(d.get("fstype", "")),
            source_is_mount=bool(d.get("source_is_mount", False)),
        )
        for p in (m.mountpoint, m.source, m.parent):
            if not p.startswith("/") or "\0" in p or os.path.normpath(p) != (p.rstrip("/") or "/"):
                raise ValueError(f"mount record with a bad path: {p!r}")
        if not m.key.startswith(KEY_PREFIX) or not m.key[len(KEY_PREFIX) :].isdigit():
            raise ValueError(f"mount record with a bad key: {m.key!r}")
        return m


@dataclass
class Survey:
    """The job's host mounts at the dump (:func:`survey`), before usage is known."""

    lines: dict[int, MountLine]  #: the job's mountinfo by mount id
    mounts: list[JobMount]
    ids: dict[str, list[int]] = field(default_factory=dict)  #: mountpoint → its mount ids

    def dump_args(self) -> list[str]:
        """CRIU's dump options naming every host mount by our key."""
        return [a for m in self.mounts for a in ("--external", f"mnt[{m.mountpoint}]:{m.key}")]


def _unescape(s: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space ...) decoded."""
    if "\\" not in s:
        return s
    out, i = bytearray(), 0
    raw = s.encode("utf-8", "surrogateescape")
    while i < len(raw):
        code = raw[i + 1 : i + 4]
        if raw[i] == 0x5C and len(code) == 3 and code.isdigit():
            out.append(int(code, 8) & 0xFF)
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return out.decode("utf-8", "surrogateescape")


def read_mountinfo(path: str) -> list[MountLine]:
    """The mounts listed in a ``mountinfo`` file, in its order."""
    out = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            a, b = left.split(), right.split()
            if len(a) < 5 or not b:
                continue
            out.append(
                MountLine(
                    int(a[0]), int(a[1]), a[2], _unescape(a[3]), _unescape(a[4]), b[0],
                    tuple(a[6:]),
                )
            )  # fmt: skip
    return out


def _within(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` ("" when equal), or None when it is not under it."""
    if root == "/":
        return path.lstrip("/")
    if path == root:
        return ""
    if path.startswith(root.rstrip("/") + "/"):
        return path[len(root.rstrip("/")) + 1 :]
    return None


def _join(base: str, rel: str) -> str:
    return base if not rel else f"{base.rstrip('/')}/{rel}"


def _host_source(m: MountLine, host: Sequence[MountLine]) -> tuple[str, bool] | None:
    """The host path whose content the job's mount ``m`` shows, and whether that path is a
    host mountpoint: the host mount at the same place with the same root when there is one,
    else (as CRIU's own detection does) the last host mount of the same device whose root
    holds ``m``'s root."""
    if any(h.dev == m.dev and h.mountpoint == m.mountpoint and h.root == m.root for h in host):
        return m.mountpoint, True
    best = None
    for h in host:
        if h.dev != m.dev:
            continue
        rel = _within(m.root, h.root)
        if rel is not None:
            best = _join(h.mountpoint, rel), not rel
    return best


def _copied(job_dir: Path | None) -> set[tuple[int, str, str, str, str]]:
    """The mounts the job's namespace was made with (``mounts-at-start``, written by its
    init), as (id, dev, root, mountpoint, fstype); empty for jobs started before it was."""
    if job_dir is None:
        return set()
    try:
        lines = read_mountinfo(str(job_dir / "mounts-at-start"))
    except (OSError, ValueError):
        return set()
    return {(m.id, m.dev, m.root, m.mountpoint, m.fstype) for m in lines}


def _stale(m: MountLine, copied: set[tuple[int, str, str, str, str]]) -> bool:
    """Whether ``m``, matching no host mount now, is a copy of one the host has since
    dropped (its mountpoint left in place): it was in the namespace as it was made, or it
    is a namespace file (nsfs), which a job cannot have mounted from a path of its own."""
    return m.fstype == "nsfs" or (m.id, m.dev, m.root, m.mountpoint, m.fstype) in copied


def survey(pid: int, job_dir: Path | None = None) -> Survey:
    """The host mounts of ``pid``'s mount namespace (compared with ours, which is CRIU's).

    Stale copies: the namespace is a copy of the host's made at the job's start; a host
    mount the host drops later while its mountpoint stays (a container's network namespace
    or shm, unmounted when the container stops) stays in the copy. CRIU cannot dump a
    namespace file it does not know the source of ("doesn't have a proper root mount") and
    dumps a tmpfs copy as the job's own, whose mountpoint may be gone by the restore
    ("Can't stat mountpoint"). Such a mount is named to CRIU like the others, from its
    mountpoint, which the host no longer has mounted: at restore it is absent, and comes
    back empty unless the job uses it (then the restore is refused, naming it)."""
    job = read_mountinfo(f"/proc/{pid}/mountinfo")
    host = read_mountinfo("/proc/self/mountinfo")
    copied = _copied(job_dir)
    by_id = {m.id: m for m in job}
    ids: dict[str, list[int]] = {}
    seen: dict[str, JobMount] = {}
    for m in job:
        parent = by_id.get(m.parent)
        if parent is None or m.mountpoint == "/":
            continue  # the namespace's root: CRIU binds it from --root
        if any(p.startswith(("shared:", "master:")) for p in m.propagation):
            continue  # CRIU's detection leaves these alone (a job spotguard run has none)
        found = _host_source(m, host)
        if found is None and _stale(m, copied):
            found = m.mountpoint, True
        if found is None:
            continue  # the job's own (its /proc): CRIU restores it from the image
        ids.setdefault(m.mountpoint, []).append(m.id)
        try:
            is_dir = os.path.isdir(f"/proc/{pid}/root{m.mountpoint}")
        except OSError:
            is_dir = True
        # one key per mountpoint (CRIU looks them up by mountpoint): the top one's source,
        # on the mount the lowest one sits on
        first = seen.get(m.mountpoint)
        key = first.key if first else f"{KEY_PREFIX}{len(seen)}"
        under = first.parent if first else parent.mountpoint
        source, whole = found
        seen[m.mountpoint] = JobMount(
            key, m.mountpoint, source, under, is_dir, fstype=m.fstype, source_is_mount=whole
        )
    return Survey(by_id, list(seen.values()), ids)


def _mnt_id_of(path: str) -> int | None:
    """The mount id of what ``path`` (a /proc magic link) points at."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _fdinfo_mnt_id(f"/proc/self/fdinfo/{fd}")
    finally:
        os.close(fd)


def _fdinfo_mnt_id(path: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _mapped(pid: int) -> Iterator[str]:
    """One ``map_files`` entry per file mapped by ``pid``."""
    seen: set[tuple[str, str]] = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6 or parts[4] == "0" or not parts[5].startswith("/"):
                    continue
                if (parts[3], parts[4]) in seen:
                    continue
                seen.add((parts[3], parts[4]))
                yield f"/proc/{pid}/map_files/{parts[0]}"
    except OSError:
        return


def used_mount_ids(pids: Iterable[int]) -> set[int]:
    """Mount ids holding the open files, mapped files, working and root directories of
    ``pids`` (processes that are gone are skipped)."""
    used: set[int] = set()
    for pid in pids:
        links = [f"/proc/{pid}/cwd", f"/proc/{pid}/root", *_mapped(pid)]
        found = [_mnt_id_of(p) for p in links]
        try:
            fds = os.listdir(f"/proc/{pid}/fdinfo")
        except OSError:
            fds = []
        found += [_fdinfo_mnt_id(f"/proc/{pid}/fdinfo/{fd}") for fd in fds]
        used.update(i for i in found if i is not None)
    return used


def mark_used(s: Survey, pids: Iterable[int]) -> list[JobMount]:
    """The survey's mounts with ``used`` set: a mount holding something of ``pids`` (run
    while the tree is frozen), or one such a mount sits on."""
    used = used_mount_ids(pids)
    closure: set[int] = set()
    for mid in used:
        while mid in s.lines and mid not in closure:
            closure.add(mid)
            mid = s.lines[mid].parent
    return [
        dataclasses.replace(m, used=any(i in closure for i in s.ids.get(m.mountpoint, [])))
        for m in s.mounts
    ]


# --- restore ----------------------------------------------------------------------------


def _order(mounts: Sequence[JobMount]) -> list[JobMount]:
    """Parents before children."""
    return sorted(mounts, key=lambda m: m.mountpoint.rstrip("/").count("/"))


def _spot(m: JobMount, here: dict[str, str]) -> str | None:
    """Where ``m``'s mountpoint is on this host, given ``here`` (the path each mount placed
    so far comes from); None when it sits on a mount CRIU restores from the image."""
    base = here.get(m.parent)
    return None if base is None else _join(base, _within(m.mountpoint, m.parent) or "")


def _mounted_here() -> frozenset[str]:
    """This host's mountpoints (ours: the namespace CRIU restores from)."""
    return frozenset(m.mountpoint for m in read_mountinfo("/proc/self/mountinfo"))


def _absent(m: JobMount, here: frozenset[str]) -> str | None:
    """Why ``m``'s host path is not what the job had, or None: the path does not exist, or
    nothing is mounted there (where a mount was)."""
    if not os.path.lexists(m.source):
        return f"{m.source} does not exist here"
    if m.source_is_mount and m.source not in here:
        return f"nothing is mounted at {m.source} here"
    return None


def _stand_ins(mounts: Sequence[JobMount], mounted: frozenset[str]) -> set[str]:
    """The mountpoints that come back empty (or are left out): the unused mounts whose host
    path or mountpoint is absent here. An unused mount (not the root) some mountpoint of which
    is absent under its host path comes back empty itself, so that the mountpoint is made in
    our stand-in, not on the host; everything on a mount that comes back empty does too."""
    out = {m.mountpoint for m in mounts if not m.used and _absent(m, mounted)}
    by_mp = {m.mountpoint: m for m in mounts}
    for m in reversed(_order(mounts)):  # children first: a parent's turn comes later
        p = by_mp.get(m.parent)
        base = "/" if m.parent == "/" else p.source if p is not None else None
        if m.used or base is None or m.mountpoint in out:
            continue
        if not os.path.lexists(_join(base, _within(m.mountpoint, m.parent) or "")):
            out.add(m.mountpoint if p is None or p.used else p.mountpoint)
    for m in _order(mounts):
        if m.parent in out:
            out.add(m.mountpoint)
    return out


def _refusal(m: JobMount, why: str, job: str) -> MissingMount:
    whose = f"job {job!r}" if job else "the job"
    origin = "" if m.source == m.mountpoint else f" (from {m.source} where it was checkpointed)"
    return MissingMount(
        f"{whose} uses the mount at {m.mountpoint}{origin}, and {why}: mount it here first, "
        "or restore on a host that has it"
    )


def check(mounts: Sequence[JobMount], *, job: str = "") -> None:
    """Raise :class:`MissingMount` naming the first mount the job uses that this host lacks
    (its host path, or its mountpoint); mounts it does not use may be absent (restore brings
    them back empty)."""
    here = {"/": "/"}
    mounted = _mounted_here()
    for m in _order(mounts):
        spot = _spot(m, here)
        here[m.mountpoint] = m.source
        if not m.used:
            continue
        why = _absent(m, mounted)
        if why is not None:
            raise _refusal(m, why, job)
        if spot is not None and not os.path.lexists(spot):
            raise _refusal(m, f"its mountpoint {spot} does not exist here", job)


@dataclass
class RestorePlan:
    """CRIU's restore options for the image's host mounts, and what was made for them."""

    args: list[str] = field(default_factory=list)
    empties: Path | None = None  #: our empty stand-ins (a private temporary directory)
    made: list[str] = field(default_factory=list)  #: mountpoints made for the restore

    def cleanup(self) -> None:
        """Remove what the restore made (deepest first): a mountpoint made on the host is
        removed again, which detaches the empty mount from the job's namespace too."""
        for p in reversed(self.made):
            try:
                if os.path.isdir(p) and not os.path.islink(p):
                    os.rmdir(p)
                else:
                    os.unlink(p)
            except OSError as exc:
                log.warning("could not remove a mountpoint made for a restore",
                            extra={"path": p, "error": str(exc)})  # fmt: skip
        self.made.clear()
        if self.empties is not None:
            shutil.rmtree(self.empties, ignore_errors=True)
            self.empties = None

    def stand_in(self, m: JobMount) -> str:
        """An empty directory or file of ours for ``m``."""
        if self.empties is None:
            self.empties = Path(tempfile.mkdtemp(prefix="spotguard-mounts-"))
        path = self.empties / m.key
        if m.is_dir:
            path.mkdir(mode=0o700)
        else:
            path.touch(mode=0o600)
        return str(path)

    def make(self, path: str, is_dir: bool) -> None:
        """Make ``path`` (a directory or an empty file) and the directories above it that
        are missing, each recorded for :meth:`cleanup`."""
        missing = []
        p = path
        while not os.path.lexists(p):
            missing.append(p)
            p = os.path.dirname(p)
        for i, q in enumerate(reversed(missing)):
            if i == len(missing) - 1 and not is_dir:
                os.close(os.open(q, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            else:
                os.mkdir(q, 0o700)
            self.made.append(q)


def plan(mounts: Sequence[JobMount], *, job: str = "") -> RestorePlan:
    """CRIU's restore options binding each host mount of the image (see the module doc);
    the caller runs :meth:`RestorePlan.cleanup` once CRIU is done."""
    check(mounts, job=job)
    out = RestorePlan()
    empty = _stand_ins(mounts, _mounted_here())
    here = {"/": "/"}
    try:
        for m in _order(mounts):
            spot = _spot(m, here)
            path = m.source
            if m.mountpoint in empty:
                path = out.stand_in(m)
                left_out = spot is not None and not os.path.lexists(spot)
                if left_out:  # made for the restore, removed after: the mount goes with it
                    out.make(str(spot), m.is_dir)
                log.info(
                    "a mount the job does not use is not on this host: "
                    + ("left out" if left_out else "restored empty"),
                    extra={"job": job, "mountpoint": m.mountpoint, "path": m.source},
                )
            here[m.mountpoint] = path
            out.args += ["--external", f"mnt[{m.key}]:{path}"]
    except OSError as exc:
        out.cleanup()
        raise PreflightError(f"cannot prepare the job's mounts for the restore: {exc}") from exc
    except BaseException:
        out.cleanup()
        raise
    return out


@contextlib.contextmanager
def planned(mounts: Sequence[JobMount], *, job: str = "") -> Iterator[RestorePlan]:
    """:func:`plan`, cleaned up when the block ends."""
    p = plan(mounts, job=job)
    try:
        yield p
    finally:
        p.cleanup()
