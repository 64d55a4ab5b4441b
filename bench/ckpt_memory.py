"""What the driver's checkpoint does to a job's host memory, and what that costs.

The driver's ``cuCheckpointProcessCheckpoint`` copies all device memory into the job's own
host memory; on the GPU machines it is the slower half of a 40 GiB freeze and its thread
spends most of its time in the kernel (``bench.stream --profile``). This shows the memory it
creates: the job's largest mappings after the checkpoint (size, resident, anonymous, huge
pages — transparent or shmem — and flags), the time of the checkpoint and of the restore, and
the job's page faults over each (``/proc/PID/stat``: minor faults, over all its threads).

    python -m bench.ckpt_memory --gib 4          # on a GPU machine, as root
    python -m bench.ckpt_memory --gib 40 --preload /tmp/hostmem_prefault.so

``--preload`` starts the job with that library preloaded (the prefault experiment:
bench/hostmem_prefault.c), ``--trace`` asks it for one line per large mapping.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from spotguard.checkpoint.cuda import CudaHook, warm

JOB = """
import sys, time, torch
t = torch.empty(int(float(sys.argv[1]) * (1 << 30)) // 2, dtype=torch.bfloat16, device="cuda")
t.normal_(0.0, 0.02)
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""
FIELDS = ("Size", "Rss", "Anonymous", "AnonHugePages", "ShmemPmdMapped", "FilePmdMapped",
          "Shared_Dirty", "Private_Dirty")  # fmt: skip


def _faults(pid: int) -> int:
    """Minor page faults of the whole process (all threads, ``stat`` field 10)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rindex(")") + 2 :].split()[7])


def _maps(pid: int, top: int) -> list[str]:
    """The ``top`` mappings by resident size, one markdown row each."""
    rows: list[tuple[int, str]] = []
    head, vals, flags = "", dict[str, int](), ""
    for line in [*Path(f"/proc/{pid}/smaps").read_text().splitlines(), "00-00 end"]:
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            if head:
                kb = {k: vals.get(k, 0) for k in FIELDS}
                cells = " | ".join(f"{kb[k] >> 10}" for k in FIELDS)
                rows.append((kb["Rss"], f"| {head} | {cells} | {flags} |"))
            parts = line.split()
            head, vals, flags = " ".join([parts[0], parts[1], *parts[5:6]]), {}, ""
        elif first == "VmFlags:":
            flags = line.split(":", 1)[1].strip()
        elif first.rstrip(":") in FIELDS:
            vals[first.rstrip(":")] = int(line.split()[1])
    rows.sort(reverse=True)
    return [r for _, r in rows[:top]]


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--preload", default="", help="library preloaded into the job")
    ap.add_argument("--trace", action="store_true", help="SPOTGUARD_HOSTMEM_TRACE=1")
    args = ap.parse_args()
    w = warm()
    if not w.driver:
        print(f"no GPU checkpoint API: {w.reason}", file=sys.stderr)
        return 1
    hook = CudaHook()
    env = dict(os.environ)
    if args.preload:
        env["LD_PRELOAD"] = args.preload
    if args.trace:
        env["SPOTGUARD_HOSTMEM_TRACE"] = "1"
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, str(args.gib)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert job.stdout is not None
        if job.stdout.readline().strip() != b"ready":
            print("the job did not start", file=sys.stderr)
            return 1
        pid = job.pid
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
        shmem = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
        print(
            f"# {args.gib:g} GiB on the GPU; thp {thp}; shmem_enabled {shmem}; "
            f"preload {args.preload or '-'}"
        )
        f0 = _faults(pid)
        t0 = time.perf_counter()
        asyncio.run(hook.lock([pid], 10.0))
        asyncio.run(hook.checkpoint([pid]))
        ckpt = time.perf_counter() - t0
        f1 = _faults(pid)
        print(f"checkpoint {ckpt:.2f} s ({args.gib / ckpt:.2f} GiB/s), {f1 - f0} minor faults")
        print("\n| mapping | " + " | ".join(f"{k} MiB" for k in FIELDS) + " | flags |")
        print("| --- " * (len(FIELDS) + 2) + "|")
        print("\n".join(_maps(pid, args.top)))
        t1 = time.perf_counter()
        asyncio.run(hook.restore([pid]))
        asyncio.run(hook.unlock([pid]))
        rest = time.perf_counter() - t1
        print(f"\nrestore+unlock {rest:.2f} s, {_faults(pid) - f1} minor faults")
        return 0
    finally:
        job.kill()
        job.wait()


if __name__ == "__main__":
    raise SystemExit(main())
