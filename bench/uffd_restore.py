"""Could the driver's restore start before the staged GPU memory is back? A measurement for the
next step of the 40 GiB restore (docs/benchmarks.md): today spotguard writes every byte of the
range the driver staged (``gpu_pages``), then the driver's restore reads it — two stages one
after the other, each ~6 s for 41 GB on an H200.

The job (PyTorch, ``--gib`` GiB of bf16 on the GPU) is locked and checkpointed by the driver;
then, inside the job, its staged range is copied aside and dropped (``MADV_DONTNEED``), and
either

* ``copy``: written back by 8 threads (into fresh pages: what a restore does now), then the
  driver restores; or
* ``uffd``: registered with ``userfaultfd`` (missing pages) and the driver's restore starts at
  once, while 8 threads fill the range in order (``UFFDIO_COPY``, 2 MiB at a time) and one
  thread serves the driver's faults first — the overlap a CRIU lazy-pages restore of that one
  range would give.

The job's checksum after the restore must equal the one before. ``--cpu`` runs the same
machinery without a GPU (the "driver" is a thread of the job reading every page), to check it.

    python -m bench.uffd_restore --gib 40 --modes copy uffd      # a GPU machine, as root
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

JOB = r'''
import ctypes, mmap, os, select, struct, sys, threading, time
GPU = sys.argv[2] == "gpu"
n = int(float(sys.argv[1]) * (1 << 30))
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
libc.ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
BLOCK, PAGE = 2 << 20, 4096

def anon():
    out = []
    for line in open("/proc/self/maps"):
        f = line.split()
        if len(f) == 5 and f[1] == "rw-p":
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            out.append((lo, hi))
    return out

if GPU:
    import torch
    tensor = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda")
    tensor.normal_(0.0, 0.02)
    def checksum():
        s = 0.0
        for i in range(0, tensor.numel(), 1 << 28):
            s += tensor[i:i + (1 << 28)].double().sum().item()
        return repr(s)
    torch.cuda.synchronize()
else:
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for off in range(0, n, 1 << 20):
        m[off:off + 8] = off.to_bytes(8, "little")
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    def checksum():
        return repr(sum(int.from_bytes(m[o:o + 8], "little") for o in range(0, n, 1 << 20)))
before = set(anon())
print("ready", checksum(), flush=True)

class Copy(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64), ("copy", ctypes.c_int64)]

UFFDIO_API, UFFDIO_REGISTER, UFFDIO_COPY = 0xC018AA3F, 0xC020AA00, 0xC028AA03
UFFDIO_MOVE, MOVE_FEATURE = 0xC028AA05, 1 << 16   # Linux 6.8+
state = {}

def staged():
    if not GPU:
        return base, base + n
    new = [r for r in anon() if r not in before and r[1] - r[0] >= 64 << 20]
    lo, hi = max(new, key=lambda r: r[1] - r[0])
    return lo, hi

def ufill(fd, src, lo, dst, hi):
    """UFFDIO_COPY [dst, hi) from src + (dst - lo), skipping pages already there."""
    while dst < hi:
        c = Copy(dst, src + (dst - lo), hi - dst, 0, 0)
        if libc.ioctl(fd, UFFDIO_COPY, ctypes.byref(c)) == 0:
            return
        err = ctypes.get_errno()
        done = max(c.copy, 0)
        if err == 17:   # EEXIST: a page there already
            dst += done + PAGE
        elif err == 11:  # EAGAIN
            dst += done
        else:
            raise OSError(err, os.strerror(err))

def prepare(mode):
    lo, hi = staged()
    size = hi - lo
    side = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    src = ctypes.addressof(ctypes.c_char.from_buffer(side))
    ctypes.memmove(src, lo, size)
    assert libc.madvise(lo, size, 4) == 0   # MADV_DONTNEED
    state.update(side=side, lo=lo, hi=hi, src=src)
    nxt = iter(range(lo, hi, BLOCK))
    lock = threading.Lock()
    def start(put):
        """8 threads taking the range's 2 MiB blocks in order, each put(block, end)."""
        def worker():
            while True:
                with lock:
                    b = next(nxt, None)
                if b is None:
                    return
                put(b, min(b + BLOCK, hi))
        ts = [threading.Thread(target=worker) for _ in range(8)]
        [t.start() for t in ts]
        return ts
    if mode == "copy":
        t0 = time.perf_counter()
        for th in start(lambda b, e: ctypes.memmove(b, src + (b - lo), e - b)):
            th.join()
        return time.perf_counter() - t0
    fd = libc.syscall(323, os.O_CLOEXEC | os.O_NONBLOCK)   # userfaultfd
    assert fd >= 0, ctypes.get_errno()
    api = (ctypes.c_uint64 * 3)(0xAA, MOVE_FEATURE if mode == "move" else 0, 0)
    assert libc.ioctl(fd, UFFDIO_API, api) == 0, ctypes.get_errno()
    reg = (ctypes.c_uint64 * 4)(lo, size, 1, 0)   # range, MISSING
    assert libc.ioctl(fd, UFFDIO_REGISTER, reg) == 0, ctypes.get_errno()
    state["faults"] = 0
    state["t0"] = time.perf_counter()
    def serve():
        p = select.poll(); p.register(fd, select.POLLIN)
        while not state.get("done"):
            if not p.poll(100):
                continue
            try:
                msg = os.read(fd, 32)
            except BlockingIOError:
                continue
            addr = struct.unpack_from("<Q", msg, 16)[0]
            b = addr - (addr - lo) % BLOCK
            state["faults"] += 1
            state["serve_one"](b, min(b + BLOCK, hi))
    if mode == "move":
        put = mover(fd, src, lo, hi)
        serve_one = put
    else:
        put = lambda b, e: ufill(fd, src, lo, b, e)
        serve_one = put
    state["serve_one"] = serve_one
    s = threading.Thread(target=serve, daemon=True); s.start()
    state["threads"] = start(put)
    return 0.0

def mover(fd, src, lo, hi):
    """put(block, end) for "move": copy the block into a scratch 2 MiB slot of this thread
    (fresh huge page, as process_vm_writev would make it), then UFFDIO_MOVE it into place
    (whole-PMD move); a block claimed by another thread is left to it (its move wakes the
    faulting thread)."""
    claimed = set()
    lock = threading.Lock()
    local = threading.local()
    def put(b, e):
        with lock:
            if b in claimed:
                return
            claimed.add(b)
        slot = getattr(local, "slot", None)
        if slot is None:
            raw = mmap.mmap(-1, 2 * BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            a = ctypes.addressof(ctypes.c_char.from_buffer(raw))
            local.raw, local.slot = raw, a + (-a) % BLOCK
            slot = local.slot
        ctypes.memmove(slot, src + (b - lo), e - b)
        m = Copy(b, slot, e - b, 0, 0)
        if libc.ioctl(fd, UFFDIO_MOVE, ctypes.byref(m)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"UFFDIO_MOVE {b:#x}: {os.strerror(err)} (moved {m.copy})")
    return put

for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "prepare":
        print("prepared", prepare(cmd[1]), flush=True)
    elif cmd[0] == "read":   # --cpu: the "driver" reads every page
        t0 = time.perf_counter()
        lo, hi = state["lo"], state["hi"]
        buf = (ctypes.c_char * PAGE)()
        for a in range(lo, hi, PAGE):
            ctypes.memmove(buf, a, 1)
        print("read", time.perf_counter() - t0, flush=True)
    elif cmd[0] == "huge":   # how much of the staged range is in huge pages now
        lo = state["lo"]
        kb, cur = 0, False
        for line in open("/proc/self/smaps"):
            f = line.split()
            if "-" in f[0] and len(f) >= 5:
                cur = int(f[0].split("-")[0], 16) == lo
            elif cur and f[0] == "AnonHugePages:":
                kb = int(f[1])
        print("huge", kb >> 10, flush=True)
    elif cmd[0] == "check":
        for th in state.get("threads", []):
            th.join()
        state["done"] = True
        filled = time.perf_counter() - state.get("t0", time.perf_counter())
        print("check", checksum(), state.get("faults", 0), f"{filled:.2f}", flush=True)
'''


def _ask(job: subprocess.Popen[str], line: str) -> list[str]:
    assert job.stdin is not None and job.stdout is not None
    job.stdin.write(line + "\n")
    job.stdin.flush()
    return job.stdout.readline().split()


def run(gib: float, mode: str, gpu: bool) -> str:
    job = subprocess.Popen([sys.executable, "-c", JOB, str(gib), "gpu" if gpu else "cpu"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert job.stdout is not None
        ready = job.stdout.readline().split()
        if not ready or ready[0] != "ready":
            return f"| {gib:g} | {mode} | the job did not start |"
        before = ready[1]
        hook = None
        ckpt = 0.0
        if gpu:
            from spotguard.checkpoint.cuda import CudaHook

            hook = CudaHook()
            t0 = time.perf_counter()
            asyncio.run(hook.lock([job.pid], 10.0))
            asyncio.run(hook.checkpoint([job.pid]))
            ckpt = time.perf_counter() - t0
        prep = float(_ask(job, f"prepare {mode}")[1])
        t1 = time.perf_counter()
        if hook is not None:
            asyncio.run(hook.restore([job.pid]))
            asyncio.run(hook.unlock([job.pid]))
        else:
            _ask(job, "read")
        rest = time.perf_counter() - t1
        huge = "—" if gpu else _ask(job, "huge")[1]
        _, after, faults, filled = _ask(job, "check")
        same = "same" if after == before else f"DIFFERENT ({before} → {after})"
        return (f"| {gib:g} | {mode} | {ckpt:.2f} | {prep:.2f} | {rest:.2f} | "
                f"**{prep + rest:.2f}** | {faults} | {filled} | {huge} | {same} |")  # fmt: skip
    finally:
        job.kill()
        job.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[4.0])
    ap.add_argument("--modes", nargs="+", default=["copy", "uffd", "move"])
    ap.add_argument("--cpu", action="store_true", help="no GPU: a thread of the job reads")
    args = ap.parse_args()
    if not args.cpu:
        from spotguard.checkpoint.cuda import warm

        w = warm()
        if not w.driver:
            print(f"no GPU checkpoint API: {w.reason}", file=sys.stderr)
            return 1
    print("| GiB | mode | driver checkpoint s | write-back before the restore s | restore "
          "s | both s | faults served | range filled after s | huge MiB after (--cpu) "
          "| data |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for gib in args.gib:
        for mode in args.modes:
            print(run(gib, mode, not args.cpu), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
