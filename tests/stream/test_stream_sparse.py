"""All-zero private memory left out of a streamed restore (:mod:`spotguard.stream.sparse`).

With real CRIU: a job whose memory holds long zero runs — in a private anonymous mapping, in a
private file mapping written over with zeros (an untouched page there would read the file,
so those must be written), and in mappings shared copy-on-write by a parent and its child
where one of the two zeroed its copy — is frozen and restored from a stream; every region of
both processes must read back exactly, and the zero runs of anonymous memory must have been
left out. The pagemap rewrite itself is checked on images built here."""

from __future__ import annotations

import contextlib
import signal
import struct
import sys
from pathlib import Path

import psutil
import pytest
from stream_helpers import wait_lines

from sgtest import wait_for
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.errors import ImageError
from spotguard.image import ImageSettings
from spotguard.stream import StreamSource, StreamTarget, sparse

pytestmark = [
    pytest.mark.criu,
    pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning"),
]

MIB = 1 << 20
PAGE = sparse.PAGE

#: a parent and a forked child; each holds its regions and, on SIGUSR1, writes a line of
#: "name:sha1" for every region into here/sums-<role>
JOB = r"""
import hashlib, mmap, os, random, signal, sys, time
here = sys.argv[1]
MIB = 1 << 20
def anon(n):
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
def noise(seed, n):
    return random.Random(seed).randbytes(n)
# A: 24 MiB, random | 12 MiB of zeros written | random
a = anon(24 * MIB)
a[: 8 * MIB] = noise(1, 8 * MIB)
a[8 * MIB : 20 * MIB] = bytes(12 * MIB)
a[20 * MIB :] = noise(2, 4 * MIB)
# F: a private map of a file of 0xAB, all of it written over with zeros
path = os.path.join(here, "backing")
with open(path, "wb") as f:
    f.write(b"\xab" * (6 * MIB))
fd = os.open(path, os.O_RDONLY)
fm = mmap.mmap(fd, 6 * MIB, flags=mmap.MAP_PRIVATE)
os.close(fd)
fm[:] = bytes(6 * MIB)
# C and D: random before the fork; after it the child zeroes C, the parent zeroes D
c = anon(8 * MIB)
c[:] = noise(3, 8 * MIB)
d = anon(8 * MIB)
d[:] = noise(4, 8 * MIB)
pid = os.fork()
role = "child" if pid == 0 else "parent"
(c if pid == 0 else d)[:] = bytes(8 * MIB)
regions = {"a": a, "f": fm, "c": c, "d": d}
def sums(sig, frame):
    text = "".join("%s:%s\n" % (k, hashlib.sha1(v).hexdigest()) for k, v in sorted(regions.items()))
    tmp = os.path.join(here, "sums-%s.tmp" % role)
    open(tmp, "w").write(text)
    os.rename(tmp, os.path.join(here, "sums-%s" % role))
signal.signal(signal.SIGUSR1, sums)
print("ready", role, flush=True)
while True:
    time.sleep(0.05)
"""


def _sums(here: Path, pids: list[int]) -> dict[str, str]:
    for p in here.glob("sums-*"):
        p.unlink()
    for pid in pids:
        psutil.Process(pid).send_signal(signal.SIGUSR1)
    want = {here / "sums-parent", here / "sums-child"}
    wait_for(lambda: all(p.exists() for p in want), "both processes' sums")
    return {p.name: p.read_text() for p in sorted(want)}


def _pages(files: dict[str, int]) -> int:
    return sum(n for name, n in files.items() if sparse.PAGES.fullmatch(name))


def _tree(pid: int) -> list[int]:
    root = psutil.Process(pid)
    return [p.pid for p in [root, *root.children(recursive=True)]]


async def _frozen(
    criu_bin: str, tmp_path: Path, name: str, settings: ImageSettings
) -> tuple[Path, dict[str, str], StreamTarget, Engine]:
    """The job started as ``name``, its regions' sums, and the job frozen (exit) into a
    stream of 1 MiB chunks."""
    here = tmp_path / "here"
    here.mkdir()
    script = tmp_path / "sparse_job.py"
    script.write_text(JOB)
    argv = [sys.executable, str(script), str(here)]
    job = await start_job(argv, name, state_dir=tmp_path / "state")
    await wait_lines(job.dir / "stdout", 2)
    before = _sums(here, _tree(job.pid))
    assert before["sums-parent"] != before["sums-child"]  # C and D differ between the two
    engine = Engine(Criu(criu_bin), settings=CheckpointSettings())
    target = StreamTarget(f"file://{tmp_path / 'store'}", work_root=tmp_path / "w",
                          writer_options={"chunk_size": MIB}, settings=settings)  # fmt: skip
    await engine.freeze(job, target, Mode.EXIT)
    assert target.url is not None and target.capture_stats is not None
    return here, before, target, engine


def _kill_tree(pid: int) -> None:
    for p in _tree(pid):
        with contextlib.suppress(psutil.Error):
            psutil.Process(p).kill()


async def test_zero_runs_of_private_memory_are_left_out_and_every_region_reads_back(
    criu_bin: str, tmp_path: Path
) -> None:
    here, before, target, engine = await _frozen(criu_bin, tmp_path, "sparse", ImageSettings())
    assert target.url is not None and target.capture_stats is not None
    restored = None
    try:
        source = StreamSource(target.url, work_root=tmp_path / "w", settings=ImageSettings())
        restored = await engine.restore(source, state_dir=tmp_path / "state")
        assert _sums(here, _tree(restored.pid)) == before
        # A's 12 MiB and the parent's D (zeroed after the fork) and the child's C: at least
        # 26 MiB of whole zero chunks; F's zeros are not anonymous and were written
        assert source.sparse_bytes >= 26 * MIB
        [step] = [st for st in restored.timeline.steps if st.name == "criu_restore"]
        assert step.detail["sparse_bytes"] == source.sparse_bytes  # in the restore's timeline
        assert source.serve_stats is not None
        # the pages served are those stored less exactly what was left out
        assert _pages(source.serve_stats.files) + source.sparse_bytes == _pages(
            target.capture_stats.files
        )
    finally:
        if restored is not None:
            _kill_tree(restored.pid)


async def test_with_sparse_restore_off_every_page_is_written(criu_bin: str, tmp_path: Path) -> None:
    off = ImageSettings(sparse_restore=False)
    here, before, target, engine = await _frozen(criu_bin, tmp_path, "dense", off)
    assert target.url is not None and target.capture_stats is not None
    restored = None
    try:
        source = StreamSource(target.url, work_root=tmp_path / "w", settings=off)
        restored = await engine.restore(source, state_dir=tmp_path / "state")
        assert _sums(here, _tree(restored.pid)) == before
        assert source.sparse_bytes == 0
        assert source.serve_stats is not None
        assert source.serve_stats.bytes == target.capture_stats.bytes
    finally:
        if restored is not None:
            _kill_tree(restored.pid)


# --- the rewrite, on images built here ---------------------------------------------------

MAGIC = struct.pack("<II", 0x54564319, 0x56084025)


def _msg(*fields: tuple[int, int]) -> bytes:
    out = bytearray()
    for f, v in fields:
        sparse._put_varint(out, f << 3)
        sparse._put_varint(out, v)
    return bytes(out)


def _image(magic: bytes, *msgs: bytes) -> bytes:
    return magic + b"".join(struct.pack("<I", len(m)) + m for m in msgs)


def _mm(*vmas: tuple[int, int, int]) -> bytes:
    entry = bytearray()
    for start, end, status in vmas:
        vma = _msg((1, start), (2, end), (3, 0), (4, 0), (5, 3), (6, 0x22), (7, status))
        sparse._put_varint(entry, (14 << 3) | 2)
        sparse._put_varint(entry, len(vma))
        entry += vma
    return _image(struct.pack("<II", 0x54564319, 0x57492820), bytes(entry))


def _pagemap(pages_id: int, *entries: tuple[int, int, int]) -> bytes:
    return _image(MAGIC, _msg((1, pages_id)),
                  *(_msg((1, v), (2, 0), (4, fl), (5, n)) for v, n, fl in entries))  # fmt: skip


ANON, FILE_PRIVATE = sparse.VMA_ANON_PRIVATE | 1, (1 << 6) | 1


def test_a_zero_run_is_cut_where_it_lies_in_anonymous_memory_only() -> None:
    base = 0x7F0000000000
    # one entry of 16 pages over an anonymous mapping (8 pages) then a file one (8 pages)
    lazy = sparse.PE_PRESENT | sparse.PE_LAZY  # as CRIU marks anonymous pages
    pm = sparse.parse_pagemap(_pagemap(3, (base, 16, lazy)))
    anon = sparse.anon_private(_mm((base, base + 8 * PAGE, ANON),
                                   (base + 8 * PAGE, base + 16 * PAGE, FILE_PRIVATE)))  # fmt: skip
    assert anon == [(base, base + 8 * PAGE)]
    # zero bytes: pages 2..11 of the pages image (a run across the two mappings)
    p = sparse.plan(pm, anon, [(2 * PAGE, 12 * PAGE)])
    assert p is not None
    assert p.dropped == [(2 * PAGE, 8 * PAGE)]  # the file mapping's zero pages stay
    got = sparse.parse_pagemap(p.pagemap)
    assert got.pages_id == 3
    assert [(e.vaddr, e.nr_pages, e.flags) for e in got.entries] == [
        (base, 2, lazy),
        (base + 8 * PAGE, 8, lazy),
    ]
    # what is served of the pages image: exactly the pages the new pagemap names
    assert sparse.kept(p.dropped, 0, 16 * PAGE) == [(0, 2 * PAGE), (8 * PAGE, 16 * PAGE)]


def test_a_run_not_on_page_boundaries_cuts_whole_pages_and_offsets_follow_the_entries() -> None:
    base, far = 0x10000, 0x900000
    pm = sparse.parse_pagemap(
        _pagemap(1, (base, 4, sparse.PE_PRESENT), (far, 6, sparse.PE_PRESENT))
    )
    anon = [(0, 1 << 40)]
    # the run starts mid-page in the first entry and ends mid-page in the second
    p = sparse.plan(pm, anon, [(2 * PAGE + 100, 7 * PAGE + 5)])
    assert p is not None
    assert p.dropped == [(3 * PAGE, 4 * PAGE), (4 * PAGE, 7 * PAGE)]
    got = sparse.parse_pagemap(p.pagemap).entries
    assert [(e.vaddr, e.nr_pages) for e in got] == [(base, 3), (far + 3 * PAGE, 3)]


def test_pages_kept_in_a_parent_image_leave_the_pagemap_as_it_is() -> None:
    pm = sparse.parse_pagemap(_pagemap(1, (0x10000, 4, sparse.PE_PARENT)))
    assert sparse.plan(pm, [(0, 1 << 40)], [(0, 4 * PAGE)]) is None
    old = sparse.parse_pagemap(_image(MAGIC, _msg((1, 1)), _msg((1, 0x10000), (2, 4))))
    assert old.entries == [sparse.Entry(0x10000, 4, sparse.PE_PRESENT)]  # no flags: present


def test_a_cut_short_image_is_a_typed_error() -> None:
    data = _pagemap(1, (0x10000, 4, sparse.PE_PRESENT))
    with pytest.raises(ImageError):
        sparse.parse_pagemap(data[:-3])
    with pytest.raises(ImageError):
        sparse.parse_pagemap(MAGIC[:5])


async def test_a_pages_image_asked_for_before_its_pagemap_is_served_by_the_same_plan() -> None:
    base = 0x7F0000000000
    anon = _mm((base, base + 8 * PAGE, ANON))
    files = {
        "pagemap-7.img": _pagemap(5, (base, 8, sparse.PE_PRESENT)),
        "pagemap-8.img": _pagemap(6, (base, 8, sparse.PE_PRESENT)),
        "mm-7.img": anon,
        "mm-8.img": anon,
    }
    reads: list[str] = []

    async def read(name: str) -> bytes:
        reads.append(name)
        return files[name]

    async def chunks(name: str) -> list[tuple[int, bool]] | None:
        # pages-5: pages 0-3 data, 4-7 zero; pages-6: all data
        return {"pages-5.img": [(4 * PAGE, False), (4 * PAGE, True)],
                "pages-6.img": [(8 * PAGE, False)]}.get(name)  # fmt: skip

    sp = sparse.SparseFiles(list(files), read, chunks)
    assert await sp.dropped("pages-5.img") == [(4 * PAGE, 8 * PAGE)]
    assert await sp.dropped("pages-6.img") is None  # nothing zero: served whole
    assert await sp.dropped("pages-9.img") is None  # no pagemap names it (a shmem one's)
    served = await sp.pagemap("pagemap-7.img")
    assert served is not None
    assert [(e.vaddr, e.nr_pages) for e in sparse.parse_pagemap(served).entries] == [(base, 4)]
    assert await sp.pagemap("pagemap-8.img") is None
    assert sp.dropped_bytes == 4 * PAGE
    assert reads.count("pagemap-7.img") == 2  # its head, then its plan; never again
    assert reads.count("pagemap-8.img") == 2
    assert await sp.dropped("pages-9.img") is None
    assert reads.count("pagemap-7.img") == 2 and reads.count("pagemap-8.img") == 2
