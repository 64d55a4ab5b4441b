"""Another process's memory, read and written by address: ``process_vm_readv``/``writev``, and
``/proc/PID/mem`` where the process protected it.

Why apart: the copies beside CRIU (:mod:`.gpupages`, :mod:`.cpupages`), the restore placed
under the driver's (:mod:`.placing`) and the staging's fault-in (:mod:`.stagefault`) all move
bytes this way; what a range is and how it is split is theirs.

Why ``process_vm_readv``/``writev`` through ``ctypes``: no maintained library wraps them, and
the call releases the GIL, so the threads copy on separate cores.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from typing import Any

from spotguard.image import memops

#: bytes moved by one process_vm_readv/writev call
_STEP = 64 << 20
#: the blocks a write-back leaves out when they are all zero: a huge page (the kernel backs
#: a written 2 MiB-aligned block with one where THP allows, so a smaller hole saves nothing)
SPARSE_BLOCK = 2 << 20


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_readv = _libc.process_vm_readv
_writev = _libc.process_vm_writev
for _fn in (_readv, _writev):
    _fn.restype = ctypes.c_ssize_t
    _fn.argtypes = (
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    )


def _move(call: Any, what: str, pid: int, addr: int, view: memoryview) -> None:
    """Copy all of ``view`` from (readv) or to (writev) ``addr`` in ``pid``; memory the
    process protected (read-only, or no access) goes through ``/proc/PID/mem`` instead."""
    n = len(view)
    with memops.address(view) as base:
        if base is None:
            raise ValueError(f"{what}: a read-only or empty buffer")
        done = 0
        while done < n:
            step = min(_STEP, n - done)
            local = _Iovec(base + done, step)
            remote = _Iovec(addr + done, step)
            got = call(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if got <= 0:
                err = ctypes.get_errno()
                if err == errno.EFAULT:  # protected where it is mapped: as a debugger does
                    _through_mem(call is _writev, what, pid, addr + done, view[done:])
                    return
                raise OSError(err, f"{what} of pid {pid} at {addr + done:#x}: {os.strerror(err)}")
            done += got


def _through_mem(write: bool, what: str, pid: int, addr: int, view: memoryview) -> None:
    """Copy ``view`` from or to ``addr`` in ``pid`` through ``/proc/PID/mem``: the kernel
    then reads and writes a private mapping whatever its protection (a job may protect part
    of a range between the choice of what spotguard copies and the freeze; restored, the
    mapping has that protection again, and its bytes go back the same way). Slower than
    ``process_vm_*`` (one copy through the kernel's buffer), so only where those fault."""
    fd = os.open(f"/proc/{pid}/mem", os.O_RDWR if write else os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            rest, at = view[done:], addr + done
            try:
                got = os.pwrite(fd, rest, at) if write else os.preadv(fd, [rest], at)
            except OSError as exc:  # EIO: not mapped there at all
                raise OSError(exc.errno, f"{what} of pid {pid} at {at:#x}: {exc.strerror}") from exc
            if got <= 0:
                raise OSError(errno.EFAULT, f"{what} of pid {pid} at {at:#x}: not mapped")
            done += got
    finally:
        os.close(fd)


def read_memory(pid: int, addr: int, view: memoryview) -> None:
    _move(_readv, "process_vm_readv", pid, addr, view)


def write_memory(pid: int, addr: int, view: memoryview) -> None:
    _move(_writev, "process_vm_writev", pid, addr, view)


def touch(pid: int, addrs: Sequence[int]) -> int:
    """Read one byte at each of ``addrs`` in ``pid`` (at most 1024): the pages fault in,
    nothing is written (:mod:`.stagefault`). Return how many were read (the first address no
    longer mapped ends the read)."""
    n = len(addrs)
    if not n:
        return 0
    buf = ctypes.create_string_buffer(n)
    local = _Iovec(ctypes.addressof(buf), n)
    remote = (_Iovec * n)(*[_Iovec(a, 1) for a in addrs])
    got = _readv(pid, ctypes.byref(local), 1, remote, n, 0)
    return max(0, int(got))


def write_nonzero(pid: int, addr: int, view: memoryview) -> int:
    """:func:`write_memory` of ``view`` at ``addr`` into memory that reads zero already (a
    mapping the restore made fresh), leaving out each :data:`SPARSE_BLOCK`-aligned block of
    it that is all zero: written, those would fault in memory the job never had (a sparse
    heap restored at its full size, and the time that takes). Returns the bytes written.
    Data costs one short compare per block (the test stops at its first non-zero byte)."""
    n = len(view)
    written = start = 0
    pos = 0
    while pos < n:
        end = min(n, pos + SPARSE_BLOCK - (addr + pos) % SPARSE_BLOCK)
        if memops.is_zero(view[pos:end]):
            if start < pos:
                write_memory(pid, addr + start, view[start:pos])
                written += pos - start
            start = end
        pos = end
    if start < n:
        write_memory(pid, addr + start, view[start:n])
        written += n - start
    return written
