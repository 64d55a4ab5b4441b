"""A job's large private memory, copied by spotguard beside CRIU, in parallel.

CRIU moves each process's pages through one pipe read by one thread: on the node a training
job rents, every rank's gigabytes of host memory leave at one pipe's pace (~4 GB/s), one rank
after another as CRIU reaches it (docs/benchmarks.md, "The pause on the H200"). The GPU
memory the driver stages is already moved beside CRIU (:mod:`.gpupages`); this module does
the same for the job's own large private anonymous mappings, through the same machinery
(``--external-pages``, ``process_vm_readv`` by several threads from the moment CRIU has
seized the tree, parts named ``cpupages-NSPID-START-K``, written back before the restored
tree runs).

Which ranges, and why they stay exact:

* **chosen before CRIU starts** (:func:`candidates`, the job still running): writable private
  anonymous mappings of at least ``min_bytes`` whose pages no other process maps — memory a
  forked worker shares copy-on-write is left to CRIU, whose restore keeps it shared (copied
  by us it would be restored twice, once per process). A fork shares at the same addresses,
  so a mapping no other process of the tree overlaps is the process's own; one that is
  overlapped is looked up in ``smaps``, and if it shares pages (``Shared_*``) only the parts
  no other process maps are kept (the kernel merges a fresh mapping into the one beside it,
  so a job's own memory often sits in one mapping with what a worker shares);
* **made exact once frozen** (:func:`frozen`): the job may map, unmap and protect memory until
  CRIU seizes it, so after the seize each chosen range is cut to the mappings it then holds.
  A hole (unmapped since) is left out — nothing there to move; a shared mapping in it is
  CRIU's (it dumps shared memory apart from the task's private pages, which is all
  ``--external-pages`` leaves out); a private mapping that is no longer readable and writable
  (``mprotect`` since) is carried all the same: where ``process_vm_readv``/``writev`` fault on
  its protection, its bytes go through ``/proc/PID/mem`` (:func:`.procmem.read_memory`), and
  CRIU restores the mapping with that protection. A job that keeps protecting memory inside
  its large mappings is frozen, not refused.

A range copied after the seize holds exactly what the frozen job had; a page it never touched
reads as zero, and a 2 MiB block of such pages is not written back (the restored mapping reads
zero already: the job's untouched memory stays untouched, :func:`.procmem.write_nonzero`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence

from spotguard.errors import CheckpointError

from .gpupages import Range, merged, minus

log = logging.getLogger(__name__)

#: a private mapping smaller than this stays with CRIU: the parts, files and ranges of many
#: small mappings would cost more than one pipe moving them
MIN_RANGE_BYTES = 256 << 20
#: the prefix of the parts' names (:func:`.gpupages.split`)
PREFIX = "cpupages"
#: the most parts copied at once by default (``[checkpoint] cpu_page_workers``)
MAX_WORKERS = 16
#: the most ranges named to CRIU (each is an argument; the largest first)
MAX_RANGES = 256
#: the most pieces those may fall into once frozen (an image records at most 1024 ranges)
MAX_PIECES = 1024


class RangeChanged(CheckpointError):
    """The ranges chosen before the freeze fell into more pieces than an image records once
    frozen (the job cut them up meanwhile). Retryable: the job runs on, the next freeze
    chooses again."""


def default_workers() -> int:
    """Parts copied at once: one per core, at most :data:`MAX_WORKERS` (the job is frozen,
    so the cores are the copy's; more threads than cores only take turns)."""
    return max(2, min(MAX_WORKERS, os.cpu_count() or 2))


# --- /proc ----------------------------------------------------------------------------------
def _vmas(pid: int, with_sharing: bool) -> list[tuple[int, int, str, bool, int]]:
    """(start, end, perms, anonymous, bytes mapped by other processes too) of every mapping
    of ``pid``; the last is read from ``smaps`` where ``with_sharing`` (else 0)."""
    out: list[tuple[int, int, str, bool, int]] = []
    path = f"/proc/{pid}/smaps" if with_sharing else f"/proc/{pid}/maps"
    with open(path, encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if not head:
                continue
            if "-" in head[0] and len(head) >= 5:
                a, _, b = head[0].partition("-")
                anon = len(head) < 6 or head[5].strip().startswith("[anon:")
                out.append((int(a, 16), int(b, 16), head[1], anon and head[4] == "0", 0))
            elif head[0] in ("Shared_Clean:", "Shared_Dirty:") and out and len(head) >= 2:
                start, end, perms, anon_, shared = out[-1]
                out[-1] = (start, end, perms, anon_, shared + int(head[1]) * 1024)
    return out


def _sharing(pid: int) -> dict[tuple[int, int], int]:
    """Bytes of each mapping of ``pid`` that another process maps too (``smaps``); empty
    where it cannot be read (every mapping then counts as sharing)."""
    try:
        return {(lo, hi): shared for lo, hi, _, _, shared in _vmas(pid, with_sharing=True)}
    except (OSError, ValueError, IndexError):
        return {}


# --- which ranges ---------------------------------------------------------------------------
def candidates(
    pids: Iterable[int],
    skip: Sequence[Range] = (),
    *,
    min_bytes: int = MIN_RANGE_BYTES,
    limit: int = MAX_RANGES,
) -> list[Range]:
    """The ranges of ``pids`` spotguard copies itself: writable private anonymous mappings
    of at least ``min_bytes`` that share no page with another process, outside ``skip`` (the
    GPU memory staged, moved by :mod:`.gpupages`); the largest ``limit``. A process gone or
    unreadable contributes none (CRIU moves its memory as ever)."""
    cut: dict[int, list[Range]] = {}
    for r in skip:
        cut.setdefault(r.pid, []).append(r)
    maps: dict[int, list[tuple[int, int, str, bool, int]]] = {}
    for pid in pids:
        try:
            maps[pid] = _vmas(pid, with_sharing=False)
        except (OSError, ValueError, IndexError):
            continue
    found: list[Range] = []
    for pid, vmas in maps.items():
        shared: dict[tuple[int, int], int] | None = None  # read once, where needed
        for lo, hi, perms, anon, _ in vmas:
            if not anon or perms != "rw-p" or hi - lo < min_bytes:
                continue
            if any(r.start < hi and lo < r.end for r in cut.get(pid, [])):
                continue
            # a fork shares its parent's memory at the same addresses: where no other process
            # of the tree maps any, none shares a page of it (no smaps walk: on a GPU process
            # it would walk the staged GPU memory too, ~30 ms per GiB of small pages)
            others = [(a, b) for q, vs in maps.items() if q != pid for a, b, *_ in vs]
            overlap = merged([(a, b) for a, b in others if a < hi and lo < b])
            pieces = [(lo, hi)]
            if overlap:
                if shared is None:
                    shared = _sharing(pid)
                if shared.get((lo, hi), 1):  # shares pages: only what no other maps is its own
                    pieces = minus(pieces, overlap)
            found += [Range(pid, a, b, PREFIX) for a, b in pieces if b - a >= min_bytes]
    found.sort(key=lambda r: r.size, reverse=True)
    return sorted(found[:limit], key=lambda r: (r.pid, r.start))


def frozen(ranges: Sequence[Range]) -> list[Range]:
    """``ranges`` cut to the private mappings they hold now that the tree is frozen: holes
    and shared mappings left out, adjacent pieces joined (a piece protected since is kept),
    a process gone left out. Raises :class:`RangeChanged` where they fall into more pieces
    than an image records, and :class:`CheckpointError` where a process's mappings cannot be
    read."""
    out: list[Range] = []
    protected: list[str] = []  # said in one line: the job is frozen while this runs
    by_pid: dict[int, list[Range]] = {}
    for r in ranges:
        by_pid.setdefault(r.pid, []).append(r)
    for pid, rs in by_pid.items():
        try:
            vmas = _vmas(pid, with_sharing=False)
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone before CRIU seized it: not in the image, nothing to carry
        except (OSError, ValueError, IndexError) as exc:
            raise CheckpointError(f"the mappings of frozen pid {pid}: {exc}") from exc
        for r in rs:
            pieces: list[tuple[int, int]] = []
            for lo, hi, perms, _anon, _ in vmas:
                lo, hi = max(lo, r.start), min(hi, r.end)
                if lo >= hi or perms[3:4] == "s":
                    continue
                if perms[:2] != "rw":  # protected since: copied through /proc/PID/mem
                    protected.append(f"pid {pid} {lo:#x}-{hi:#x} {perms}")
                if pieces and pieces[-1][1] == lo:
                    pieces[-1] = (pieces[-1][0], hi)
                else:
                    pieces.append((lo, hi))
            out += [Range(pid, lo, hi, PREFIX) for lo, hi in pieces]
    if protected:
        log.info(
            "memory chosen to copy beside CRIU was protected before the freeze",
            extra={"ranges": len(protected), "what": "; ".join(protected[:4])},
        )
    if len(out) > MAX_PIECES:
        raise RangeChanged(f"the memory chosen to copy beside CRIU fell into {len(out)} pieces")
    if sum(r.size for r in out) != sum(r.size for r in ranges):
        log.info(
            "memory chosen to copy beside CRIU changed before the freeze",
            extra={"ranges": len(out), "bytes": sum(r.size for r in out)},
        )
    return out
