"""All-zero memory left out of a streamed restore: it reads zero without being written.

A job's private anonymous memory often holds long runs of zero pages that were written (a
tensor of zeros, a zeroed buffer, an allocator's cleared reserve). CRIU dumps them as present
pages, and a restore would fault in, zero and then copy every one of them through its pipe —
for a rank whose memory is half zeros, half of its restore. The image already knows which
chunks are all zero (their authenticated address is that of zero bytes), so the served image
says so to CRIU instead:

- ``pagemap-ID.img`` is served with the zero runs cut out of its entries, where they fall in
  a private anonymous mapping (``mm-ID.img``): a page that the pagemap does not name is left
  untouched by the restore and reads zero — also in a mapping shared copy-on-write with the
  parent task, whose pages the child's pagemap lacks are dropped from the child by CRIU;
- ``pages-N.img`` (the pagemap head's ``pages_id``) is served without those bytes.

Private file mappings keep their zero pages (an untouched page there reads the file), and a
pagemap with entries of any other kind (pages in a parent image) is served as it is. Nothing
here is trusted that the reader has not verified: the pagemap, the mm image and the chunk
addresses all come through it.

Why a small wire-format reader and not a protobuf library: the three messages used are fixed
by CRIU's image format (``images/pagemap.proto``, ``mm.proto``, ``vma.proto``), and the
generated code would need CRIU's ``.proto`` files shipped and compiled for a few fields.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import re
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spotguard.errors import ImageError
from spotguard.image.buffers import OwnedChunk

if TYPE_CHECKING:
    from spotguard.image.reader import ImageReader

PAGE = 4096
PE_PARENT, PE_LAZY, PE_PRESENT = 1 << 0, 1 << 1, 1 << 2
VMA_ANON_PRIVATE = 1 << 9
PAGEMAP = re.compile(r"pagemap-(\d+)\.img")
PAGES = re.compile(r"pages-(\d+)\.img")

Span = tuple[int, int]  # [start, end)
_Read = Callable[[str], Awaitable[bytes]]
_Chunks = Callable[[str], Awaitable[list[tuple[int, bool]] | None]]

log = logging.getLogger(__name__)


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ImageError("a CRIU image entry is cut short")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(msg: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: an int, or bytes (length-delimited)."""
    pos = 0
    while pos < len(msg):
        key, pos = _varint(msg, pos)
        kind = key & 7
        if kind == 0:
            value, pos = _varint(msg, pos)
            yield key >> 3, value
        elif kind == 2:
            n, pos = _varint(msg, pos)
            if pos + n > len(msg):
                raise ImageError("a CRIU image entry is cut short")
            yield key >> 3, msg[pos : pos + n]
            pos += n
        elif kind in (1, 5):
            n = 8 if kind == 1 else 4
            yield key >> 3, int.from_bytes(msg[pos : pos + n], "little")
            pos += n
        else:
            raise ImageError(f"a CRIU image entry has wire type {kind}")


def _put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _entries(data: bytes) -> tuple[bytes, list[bytes]]:
    """A CRIU image: its two magics, then its entries (each a size and a message)."""
    if len(data) < 8:
        raise ImageError("a CRIU image is shorter than its magic")
    out, pos = [], 8
    while pos < len(data):
        if pos + 4 > len(data):
            raise ImageError("a CRIU image entry is cut short")
        (n,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + n > len(data):
            raise ImageError("a CRIU image entry is cut short")
        out.append(data[pos : pos + n])
        pos += n
    return data[:8], out


@dataclass(frozen=True)
class Entry:
    vaddr: int
    nr_pages: int
    flags: int


@dataclass(frozen=True)
class Pagemap:
    magic: bytes
    head: bytes  # the pagemap head entry, served as it came
    pages_id: int
    entries: list[Entry]


def parse_pagemap(data: bytes) -> Pagemap:
    magic, msgs = _entries(data)
    if not msgs:
        raise ImageError("a pagemap image has no head")
    pages_id = next((int(v) for f, v in _fields(msgs[0]) if f == 1 and isinstance(v, int)), -1)
    entries = []
    for msg in msgs[1:]:
        vaddr = compat = 0
        nr: int | None = None
        flags: int | None = None
        parent = False
        for f, v in _fields(msg):
            if isinstance(v, bytes):
                continue
            if f == 1:
                vaddr = v
            elif f == 2:
                compat = v
            elif f == 3:
                parent = bool(v)
            elif f == 4:
                flags = v
            elif f == 5:
                nr = v
        if flags is None:  # an image from before the flags field
            flags = PE_PARENT if parent else PE_PRESENT
        entries.append(Entry(vaddr, compat if nr is None else nr, flags))
    return Pagemap(magic, msgs[0], pages_id, entries)


def encode_pagemap(pm: Pagemap) -> bytes:
    """The image of ``pm``, its entries written as CRIU writes them (``nr_pages`` in the 64-bit
    field, the 32-bit one zero)."""
    out = bytearray(pm.magic)
    out += struct.pack("<I", len(pm.head)) + pm.head
    for e in pm.entries:
        msg = bytearray()
        for field, value in ((1, e.vaddr), (2, 0), (4, e.flags), (5, e.nr_pages)):
            _put_varint(msg, field << 3)
            _put_varint(msg, value)
        out += struct.pack("<I", len(msg)) + msg
    return bytes(out)


def anon_private(mm: bytes) -> list[Span]:
    """The private anonymous mappings of an ``mm-ID.img``, sorted."""
    _, msgs = _entries(mm)
    if len(msgs) != 1:
        raise ImageError(f"an mm image has {len(msgs)} entries")
    spans = []
    for f, vma in _fields(msgs[0]):
        if f != 14 or not isinstance(vma, bytes):
            continue
        v = {k: x for k, x in _fields(vma) if isinstance(x, int)}
        if v.get(7, 0) & VMA_ANON_PRIVATE:
            spans.append((v.get(1, 0), v.get(2, 0)))
    return sorted(spans)


def _cut(spans: Sequence[Span], lo: int, hi: int) -> Iterator[Span]:
    """The parts of sorted, disjoint ``spans`` inside ``[lo, hi)``."""
    i = max(bisect.bisect_right(spans, (lo, lo)) - 1, 0)
    while i < len(spans) and spans[i][0] < hi:
        a, b = max(spans[i][0], lo), min(spans[i][1], hi)
        if a < b:
            yield a, b
        i += 1


def merged(spans: Sequence[Span]) -> list[Span]:
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif a < b:
            out.append((a, b))
    return out


@dataclass(frozen=True)
class Plan:
    """A pagemap served with the zero runs cut out, and the bytes of its pages image left out
    (offsets in the image as stored, sorted)."""

    pagemap: bytes
    dropped: list[Span]

    @property
    def dropped_bytes(self) -> int:
        return sum(b - a for a, b in self.dropped)


def plan(pm: Pagemap, anon: Sequence[Span], zero: Sequence[Span]) -> Plan | None:
    """Cut from ``pm`` the pages that lie in all-zero runs of its pages image (``zero``: byte
    spans of that image) and in a private anonymous mapping (``anon``); None when nothing is
    cut, or when the pagemap has entries of another kind than present pages (whose bytes are
    in this image, in order; a restore here never takes lazy pages)."""
    if any(e.flags & ~PE_LAZY != PE_PRESENT for e in pm.entries):
        return None  # (CRIU marks anonymous pages lazy-capable; their bytes are in the image)
    zero = merged(zero)
    anon = merged(anon)
    entries: list[Entry] = []
    dropped: list[Span] = []
    off = 0
    for e in pm.entries:
        length = e.nr_pages * PAGE
        cuts: list[Span] = []  # in addresses
        for za, zb in _cut(zero, off, off + length):
            lo = e.vaddr + -(-(za - off) // PAGE) * PAGE  # whole pages only
            hi = e.vaddr + (zb - off) // PAGE * PAGE
            cuts.extend(_cut(anon, lo, hi))
        at = e.vaddr
        for a, b in cuts:
            if a > at:
                entries.append(Entry(at, (a - at) // PAGE, e.flags))
            dropped.append((off + a - e.vaddr, off + b - e.vaddr))
            at = b
        if at < e.vaddr + length:
            entries.append(Entry(at, (e.vaddr + length - at) // PAGE, e.flags))
        off += length
    if not dropped:
        return None
    return Plan(encode_pagemap(Pagemap(pm.magic, pm.head, pm.pages_id, entries)), dropped)


def kept(dropped: Sequence[Span], lo: int, hi: int) -> list[Span]:
    """The parts of ``[lo, hi)`` not in ``dropped`` (sorted, disjoint)."""
    out, at = [], lo
    for a, b in _cut(dropped, lo, hi):
        if a > at:
            out.append((at, a))
        at = b
    if at < hi:
        out.append((at, hi))
    return out


class SparseFiles:
    """The pagemaps and pages images of a streamed restore, served sparse (see the module).

    ``read(name)`` gives a whole (small) image file's bytes; ``chunks(name)`` the (size,
    all-zero) of each stored chunk of a file, in order. Plans are made once per pages image,
    when its pagemap or itself is first asked for, and cached (CRIU may open a file twice).
    """

    def __init__(self, names: Sequence[str], read: _Read, chunks: _Chunks) -> None:
        self._names = set(names)
        self._pagemaps = sorted(n for n in self._names if PAGEMAP.fullmatch(n))
        self._read = read
        self._chunks = chunks
        self._plans: dict[str, Plan | None] = {}  # by pagemap name
        self._owner: dict[int, str] = {}  # pages_id -> its pagemap's name, as learnt
        self._lock = asyncio.Lock()
        self.dropped_bytes = 0

    async def pagemap(self, name: str) -> bytes | None:
        """The pagemap ``name`` as served, or None to serve it as stored."""
        if not PAGEMAP.fullmatch(name):
            return None
        p = await self._plan(name)
        return None if p is None else p.pagemap

    async def dropped(self, name: str) -> list[Span] | None:
        """The spans of pages image ``name`` left out, or None to serve it whole."""
        m = PAGES.fullmatch(name)
        if m is None:
            return None
        want = int(m.group(1))
        async with self._lock:  # its pagemap was planned first (CRIU opens it first); if not,
            for pm in self._pagemaps:  # the heads of those not planned yet say which it is
                if want in self._owner:
                    break
                if pm not in self._plans and pm not in self._owner.values():
                    self._owner[parse_pagemap(await self._read(pm)).pages_id] = pm
        owner = self._owner.get(want)
        p = None if owner is None else await self._plan(owner)
        return None if p is None else p.dropped

    async def _plan(self, pagemap: str) -> Plan | None:
        async with self._lock:
            if pagemap in self._plans:
                return self._plans[pagemap]
            m = PAGEMAP.fullmatch(pagemap)
            assert m is not None
            pm = parse_pagemap(await self._read(pagemap))
            self._owner[pm.pages_id] = pagemap
            pages, mm = f"pages-{pm.pages_id}.img", f"mm-{m.group(1)}.img"
            p = None
            chunks = await self._chunks(pages) if pm.entries and mm in self._names else None
            zero, off = [], 0
            for size, is_zero in chunks or []:
                if is_zero:
                    zero.append((off, off + size))
                off += size
            if zero:
                p = plan(pm, anon_private(await self._read(mm)), zero)
            self._plans[pagemap] = p
            if p is not None:
                self.dropped_bytes += p.dropped_bytes
                log.info(
                    "zero pages left out of the restore",
                    extra={"file": pages, "bytes": p.dropped_bytes},
                )
            return p


class ReaderSource:
    """:class:`~spotguard.stream.serve.ServeSource` over an open ``ImageReader``; with
    ``sparse``, all-zero private memory is left out of the pages CRIU reads
    (:mod:`spotguard.stream.sparse`)."""

    def __init__(
        self,
        reader: ImageReader,
        criu_files: set[str],
        renames: dict[str, str],
        *,
        sparse: bool = False,
    ):
        self.reader = reader
        self.criu_files = criu_files
        self.renames = renames
        self.sparse = SparseFiles(sorted(criu_files), self._read, self._chunks) if sparse else None

    def exists(self, name: str) -> bool:
        return name in self.criu_files

    def iter_file(self, name: str) -> AsyncIterator[bytes | OwnedChunk]:
        if self.sparse is None:
            return self.reader.iter_file_owned(self.renames.get(name, name))
        return self._sparse(self.sparse, name)

    async def _sparse(self, sp: SparseFiles, name: str) -> AsyncIterator[bytes | OwnedChunk]:
        served = await sp.pagemap(name)
        if served is not None:
            yield served
            return
        dropped = await sp.dropped(name) or []
        off = 0
        async for chunk in self.reader.iter_file_owned(self.renames.get(name, name)):
            lo, off = off, off + chunk.size
            parts = kept(dropped, lo, off) if dropped else [(lo, off)]
            if parts == [(lo, off)]:
                yield chunk
                continue
            chunk.close()  # an all-zero chunk (only those are cut): what is left of it
            for a, b in parts:
                yield bytes(b - a)

    async def _read(self, name: str) -> bytes:
        parts = [d async for d in self.reader.iter_file(self.renames.get(name, name))]
        return b"".join(parts)

    async def _chunks(self, name: str) -> list[tuple[int, bool]] | None:
        if name not in self.criu_files:
            return None
        zero = self.reader.codec.zero_address
        refs = self.reader.manifest.file(self.renames.get(name, name)).chunks
        return [(r.size, r.digest == zero(r.size)) for r in refs]
