"""Placing the staged GPU memory while the driver's restore reads it
(:mod:`spotguard.checkpoint.placing`, :mod:`spotguard.checkpoint.inject`), on real processes:
a reader inside the process reads every page of a range from the moment it is registered and
must see exactly what is placed, never a page too early."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spotguard.checkpoint import inject, placing
from spotguard.errors import InjectError

MIB = 1 << 20
SIZE = 96 * MIB
CHUNK = 8 * MIB

#: a process with an untouched 2 MiB-aligned range; on "read" its main thread reads the first
#: 8 bytes of every page of it (as the driver's restore reads the staged range) and prints
#: their sum, then the range's huge-page KiB
JOB = r"""
import ctypes, mmap, sys
n = int(sys.argv[1])
m = mmap.mmap(-1, n + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
a = ctypes.addressof(ctypes.c_char.from_buffer(m))
base = a + (-a) % (2 << 20)
print(base, flush=True)
for line in sys.stdin:
    if line.strip() == "read":
        s = sum(int.from_bytes(ctypes.string_at(base + o, 8), "little") for o in range(0, n, 4096))
        kb = 0
        for l in open("/proc/self/smaps"):
            f = l.split()
            if "-" in f[0] and len(f) >= 5:
                cur = int(f[0].split("-")[0], 16) <= base < int(f[0].split("-")[1], 16)
            elif cur and f[0] == "AnonHugePages:":
                kb += int(f[1])
        print(s, kb, flush=True)
"""


def _chunk(off: int) -> bytearray:
    """Chunk at ``off``: every page's first 8 bytes its own address offset; the rest 0xA5."""
    b = bytearray(b"\xa5" * CHUNK)
    for p in range(0, CHUNK, 4096):
        b[p : p + 8] = (off + p).to_bytes(8, "little")
    return b


def _zero_chunk(off: int) -> bool:
    return (off // CHUNK) % 4 == 1  # a quarter of the range is all zero


def _expected() -> int:
    return sum(o for o in range(0, SIZE, 4096) if not _zero_chunk(o - o % CHUNK))


@pytest.fixture
def job() -> subprocess.Popen[str]:
    if not inject.supported():
        pytest.skip("system calls are injected on x86-64 only")
    proc = subprocess.Popen([sys.executable, "-c", JOB, str(SIZE)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    yield proc
    proc.kill()
    proc.wait()


def _base(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    return int(proc.stdout.readline())


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_a_reader_waits_for_each_chunk_and_sees_exactly_what_was_placed(
    job: subprocess.Popen[str],
) -> None:
    base = _base(job)
    before = _maps(job.pid)
    placer = placing.Placer(job.pid, [(base, base + SIZE)], slots=2, slot=CHUNK)
    assert _maps(job.pid) != before  # the scratch mapping
    assert job.stdin is not None and job.stdout is not None
    job.stdin.write("read\n")
    job.stdin.flush()
    time.sleep(0.3)  # the reader is now waiting on the range's first page

    def place(offs: range) -> None:
        for off in offs:
            if _zero_chunk(off):
                placer.zero(base + off, CHUNK)
            else:
                placer.put(base + off, memoryview(_chunk(off)))
            time.sleep(0.01)

    half = SIZE // 2
    writers = [threading.Thread(target=place, args=(range(s, s + half, CHUNK),))
               for s in (0, half)]  # fmt: skip
    try:
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        assert placer.stats.moved_bytes == SIZE * 3 // 4  # else the reader would wait on
        total, huge_kb = (int(x) for x in job.stdout.readline().split())
    finally:
        placer.close()  # a reader still waiting is let go (and reads zero)
    assert total == _expected()
    assert placer.stats.moved_bytes == SIZE * 3 // 4
    assert placer.stats.zero_bytes == SIZE // 4
    assert placer.stats.faults >= 1  # the reader did wait
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().find("[always]") >= 0:
        assert huge_kb > 0  # moved as huge pages, not 4 KiB copies
    assert _maps(job.pid) == before  # the scratch mapping is gone, the range stays
    assert job.poll() is None  # the process runs on: its registers came back intact


def test_injected_calls_return_the_kernels_answer_and_leave_the_process_running(
    job: subprocess.Popen[str],
) -> None:
    _base(job)
    with inject.Injector(job.pid) as inj:
        fd = inj.call(inject.NR_USERFAULTFD, os.O_CLOEXEC)
        assert fd >= 0
        assert inj.call(inject.NR_CLOSE, fd) == 0
        assert inj.call(inject.NR_CLOSE, fd) < 0  # -EBADF, as the kernel says
        with pytest.raises(InjectError, match="EBADF"):
            inject.check(inj.call(inject.NR_CLOSE, fd), "close", job.pid)
    assert job.stdin is not None and job.stdout is not None
    job.stdin.write("read\n")
    job.stdin.flush()
    assert job.stdout.readline().split()[0] == "0"  # nothing placed: the range reads zero


def test_where_placing_cannot_be_set_up_the_restore_writes_back_first() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    from spotguard.checkpoint.gpupages import GpuPages, Part

    pages = [GpuPages(ns_pid=7, start=0x7F0000000000, end=0x7F0000000000 + CHUNK,
                      parts=(Part("gpupages-7-7f0000000000-0", 0, CHUNK),))]  # fmt: skip
    places, why = placing.open_placers(pages, {7: gone.pid}, 2, CHUNK)
    assert places is None and why  # says why: the process is gone
    assert mmap.PAGESIZE > 0


def test_doctor_says_whether_this_host_can_place_a_restore() -> None:
    ok, found, fix = placing.readiness()
    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    if inject.supported() and release >= (6, 8) and os.geteuid() == 0:
        assert ok, found  # this machine: the whole set-up works on a probe process
        assert "UFFDIO_MOVE" in found and not fix
    else:
        assert not ok and found
