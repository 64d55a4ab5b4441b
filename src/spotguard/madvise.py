"""``MADV_POPULATE_WRITE`` (Linux 5.14), which Python's ``mmap`` module lacks: fault in and
zero a range of anonymous memory for writing in one call, so that its first write later costs
only the write. ``ctypes`` releases the GIL for the call, so several threads populate at once.

A leaf module (libc only) so that the agent's memory warm-up child (:mod:`spotguard.warm`),
the image pipeline's buffers (:mod:`spotguard.image.memops`) and the benchmarks share one
binding without importing one another's packages.
"""

from __future__ import annotations

import ctypes
import os
import threading

#: madvise(2) advice: populate (prefault) pages for writing
MADV_POPULATE_WRITE = 23

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def populate(addr: int, size: int) -> int:
    """Fault in ``size`` bytes of this process's memory at ``addr`` for writing; 0, or the
    errno (EINVAL on a kernel without the advice: the pages are then faulted when written)."""
    if size <= 0 or _madvise(addr, size, MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


def populate_split(addr: int, size: int, threads: int) -> None:
    """:func:`populate` ``size`` bytes at ``addr`` by ``threads`` threads at once, each a
    whole number of 2 MiB huge pages; raises :class:`OSError` with the first errno."""
    step = -(-size // max(1, threads)) // (2 << 20) * (2 << 20) or size
    errors: list[int] = []

    def one(lo: int) -> None:
        err = populate(addr + lo, min(step, size - lo))
        if err:
            errors.append(err)

    ts = [threading.Thread(target=one, args=(lo,)) for lo in range(0, size, step)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise OSError(errors[0], f"MADV_POPULATE_WRITE: {os.strerror(errors[0])}")
