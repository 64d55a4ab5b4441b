"""A job holding a deleted, mapped shared-memory file, as NCCL's proxy does (/dev/shm/nccl-*,
34 MB seen): it fills 32 MiB, unlinks the file, and every step prints the step and a checksum
of the mapping (after changing one byte of it).

    python shm_ghost.py STEPS STEP_SECONDS
"""

import hashlib
import mmap
import os
import sys
import tempfile
import time

steps, pause = int(sys.argv[1]), float(sys.argv[2])
size = 32 << 20
fd, path = tempfile.mkstemp(prefix="sg-ghost-", dir="/dev/shm")
os.ftruncate(fd, size)
m = mmap.mmap(fd, size)
for i in range(0, size, 1 << 20):
    m[i : i + (1 << 20)] = hashlib.sha256(str(i).encode()).digest() * (1 << 15)
os.unlink(path)
os.close(fd)
for step in range(steps):
    m[(step * 4099) % size] = step % 256
    print(f"step {step} {hashlib.sha256(m).hexdigest()[:16]}", flush=True)
    time.sleep(pause)
