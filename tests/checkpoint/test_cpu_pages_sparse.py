"""Memory a job never touched inside a range carried beside CRIU stays untouched once restored.

A range copied beside CRIU (:mod:`spotguard.checkpoint.cpupages`) reads zero where the job
never wrote; its chunks are written back into the restored process with ``process_vm_writev``.
A chunk that is all zero was always left out; one with data in it was written whole, zeros
and all — faulting in, on the new VM, memory the job never had (a sparse heap restored at
its full size). Now only the 2 MiB blocks with data are written. Real CRIU, a real process
that reports its own resident memory.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import psutil
from ckpt_helpers import kill_tree

from sgtest import until
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget

MIB = 1 << 20
RANGE_MIB = 128

#: a range of RANGE_MIB whose even 2 MiB blocks (by address) hold data, the odd ones never
#: touched; on SIGUSR1 it checks every byte and writes "ok|BAD RSS_KIB" of the range to OUT/checked
SPARSE_JOB = """
import ctypes, mmap, os, random, re, signal, sys, time
out, n = sys.argv[1], int(sys.argv[2]) << 20
B = 2 << 20
m = mmap.mmap(-1, n + B, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
c = ctypes.c_char.from_buffer(m)
base = ctypes.addressof(c)
del c
first = (-base) % B
blocks = [first + i * B for i in range(n // B)]
for i, off in enumerate(blocks):
    if i % 2 == 0:
        m[off:off + B] = random.Random(i).randbytes(B)

def rss_kib():
    lo, hi, total, inside = base, base + n + B, 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                s, e = int(head.group(1), 16), int(head.group(2), 16)
                inside = s < hi and e > lo
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total

def publish(name, text):
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(out, name + ".tmp"), os.path.join(out, name))

def check(sig, frame):
    zero = bytes(B)
    ok = all(
        m[off:off + B] == (random.Random(i).randbytes(B) if i % 2 == 0 else zero)
        for i, off in enumerate(blocks)
    )
    publish("checked", "%s %d" % ("ok" if ok else "BAD", rss_kib()))

signal.signal(signal.SIGUSR1, check)
publish("ready", "%d" % rss_kib())
while True:
    time.sleep(0.05)
"""


async def test_blocks_the_job_never_touched_are_not_faulted_in_by_the_restore(
    patched: str, tmp_path: Path
) -> None:
    """Half of a carried range's 2 MiB blocks hold data, the rest were never touched: frozen,
    restored, every byte is as it was and the range's resident memory is still about half
    of it — not all of it, as when every chunk with data in it was written whole."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "sparse_job.py"
    script.write_text(SPARSE_JOB)
    job = await start_job(
        [sys.executable, str(script), str(out), str(RANGE_MIB)], "sparse", state_dir=tmp_path / "st"
    )
    settings = CheckpointSettings(
        state_dir=tmp_path / "st", criu=patched, shm_dir=tmp_path / "shm", criu_timeout=60,
        cpu_pages_min_mib=64,
    )  # fmt: skip
    engine = Engine(Criu(patched), settings=settings)
    restored = None
    try:
        await until(lambda: (out / "ready").exists(), "the job's memory", 60)
        before_kib = int((out / "ready").read_text())
        half_kib = RANGE_MIB * 1024 // 2
        assert before_kib < 1.2 * half_kib, f"the job's own premise: {before_kib} KiB resident"
        frozen = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        assert frozen.meta.cpu_pages, "the range was not carried beside CRIU"
        restored = await engine.restore(DirectorySource(tmp_path / "img"))
        [parent] = [c.pid for c in psutil.Process(restored.pid).children()]
        os.kill(parent, signal.SIGUSR1)
        await until(lambda: (out / "checked").exists(), "the restored job's check", 60)
        verdict, after = (out / "checked").read_text().split()
        assert verdict == "ok", "the restored memory differs"
        assert int(after) < 1.2 * half_kib, (
            f"{int(after) // 1024} MiB of the {RANGE_MIB} MiB range resident after the restore "
            f"(before: {before_kib // 1024} MiB)"
        )
    finally:
        kill_tree(restored.pid if restored else job.pid)
