"""Another process's memory written back sparsely (:func:`spotguard.checkpoint.procmem.
write_nonzero`): only the 2 MiB-aligned blocks with data are written, wherever the view starts.
Real ``process_vm_writev`` into a fresh mapping (of this process: the call is the same)."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from spotguard.checkpoint.procmem import SPARSE_BLOCK, write_nonzero

B = SPARSE_BLOCK


def _fresh(n: int) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    c = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(c)
    del c
    return m, addr


@pytest.mark.parametrize("skew", [0, 4096, B // 2 + 4096])
def test_only_blocks_with_data_are_written_wherever_the_view_starts(skew: int) -> None:
    """A view of 5 blocks starting ``skew`` bytes past a block boundary: data in the first
    partial block, a whole zero block, one byte at the very end of a block, then zeros to
    the end. Every byte lands; the zero blocks (by the destination's alignment) are skipped."""
    dest, base = _fresh(8 * B)
    start = base + (-base) % B + skew  # `skew` past a 2 MiB boundary of the destination
    n = 5 * B
    src = bytearray(n)
    src[:4096] = os.urandom(4096)  # in the first (partial) block
    one = (start // B + 3) * B - 1 - start  # the last byte of the block before the fourth
    src[one] = 0x5A
    written = write_nonzero(os.getpid(), start, memoryview(src))
    off = start - base
    assert dest[off : off + n] == bytes(src)
    first = B - skew % B  # the partial first block, written
    assert written == first + B, written  # that block and the one holding `one`


def test_all_zero_and_all_data() -> None:
    dest, base = _fresh(4 * B)
    start = base + (-base) % B
    assert write_nonzero(os.getpid(), start, memoryview(bytearray(2 * B))) == 0
    data = os.urandom(2 * B)
    assert write_nonzero(os.getpid(), start, memoryview(bytearray(data))) == 2 * B
    assert dest[start - base : start - base + 2 * B] == data


def test_a_read_only_buffer_is_never_skipped_unseen() -> None:
    """The zero test cannot look into a read-only buffer, so nothing of it is skipped: it
    goes to the write, which refuses it as :func:`write_memory` always did (the restore's
    buffers are its own, writable)."""
    _keep, base = _fresh(2 * B)
    data = bytes(B)  # zeros, read-only
    with pytest.raises(ValueError, match="read-only"):
        write_nonzero(os.getpid(), base, memoryview(data))
