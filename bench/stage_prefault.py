"""The driver's checkpoint with and without spotguard faulting its staging memory beside it
(:mod:`spotguard.checkpoint.stagefault`).

A PyTorch job holds ``--gib`` GiB of bf16 on the GPU; it is locked and checkpointed by the
driver, either alone (``none``) or while ``Prefault`` reads every huge page of what the driver
maps with N threads (``prefault:N``; ``prefault`` = the default count), then restored and
unlocked. The job's checksum after must equal the one before. Runs alternate modes on one VM
(its first touches of memory are slower than later ones).

``--cpu`` runs the same machinery without a GPU: the "driver" is a thread of the job that maps
the range and writes every page of it in order; the job then checks every page holds what it
wrote.

    python -m bench.stage_prefault --gib 8 40 --modes none prefault none prefault   # as root
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

JOB = r"""
import ctypes, mmap, sys, time
GPU = sys.argv[2] == "gpu"
n = int(float(sys.argv[1]) * (1 << 30))
HUGE = 2 << 20
if GPU:
    import torch
    tensor = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda")
    tensor.normal_(0.0, 0.02)
    torch.cuda.synchronize()
    def checksum():
        s = 0.0
        for i in range(0, tensor.numel(), 1 << 28):
            s += tensor[i:i + (1 << 28)].double().sum().item()
        return repr(s)
else:
    def checksum():
        return "cpu"
print("ready", checksum(), flush=True)
state = {}
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "stage":   # --cpu: what the driver does, from one thread
        t0 = time.perf_counter()
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        for i, off in enumerate(range(0, n, HUGE)):
            ctypes.memset(base + off, 1 + i % 251, min(HUGE, n - off))
        state["m"] = m
        print("staged", time.perf_counter() - t0, flush=True)
    elif cmd[0] == "check":
        m = state.get("m")
        bad = 0
        if m is not None:
            for i, off in enumerate(range(0, n, 4096)):
                if m[off] != 1 + (off // HUGE) % 251:
                    bad += 1
        print("check", checksum(), bad, flush=True)
"""


def _ask(job: subprocess.Popen[str], line: str) -> list[str]:
    assert job.stdin is not None and job.stdout is not None
    job.stdin.write(line + "\n")
    job.stdin.flush()
    return job.stdout.readline().split()


async def _checkpoint(
    pid: int, mode: str, gpu: bool, job: subprocess.Popen[str]
) -> tuple[float, dict[str, object]]:
    from spotguard.checkpoint import stagefault

    workers = int(mode.split(":")[1]) if ":" in mode else None
    on = mode.startswith("prefault")
    hook = None
    if gpu:
        from spotguard.checkpoint.cuda import CudaHook

        hook = CudaHook()
        await hook.lock([pid], 10.0)
    from spotguard.checkpoint import gpupages

    before = {pid: gpupages.writable_anon(pid)}
    t0 = time.perf_counter()
    async with stagefault.prefaulting([pid], on, workers) as stats:
        if hook is not None:
            await hook.checkpoint([pid])
        else:
            await asyncio.to_thread(_ask, job, "stage")
    took = time.perf_counter() - t0
    detail: dict[str, object] = {"active": stats.active, **stats.to_json()}
    staged = gpupages.staged_ranges(before)
    detail["staged_gb"] = sum(r.size for r in staged) / 1e9
    detail["resident_gb"] = _resident(pid, [(r.start, r.end) for r in staged]) / 1e9
    if hook is not None:
        t1 = time.perf_counter()
        await hook.restore([pid])
        await hook.unlock([pid])
        detail["restore_s"] = round(time.perf_counter() - t1, 2)
    return took, detail


def _resident(pid: int, ranges: list[tuple[int, int]]) -> int:
    """Bytes resident in ``ranges`` of ``pid`` (the Rss of the mappings inside them)."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = any(a <= lo and hi <= b for a, b in ranges)
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def run(gib: float, mode: str, gpu: bool) -> str:
    job = subprocess.Popen([sys.executable, "-c", JOB, str(gib), "gpu" if gpu else "cpu"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert job.stdout is not None
        ready = job.stdout.readline().split()
        if not ready or ready[0] != "ready":
            return f"| {gib:g} | {mode} | the job did not start |"
        took, d = asyncio.run(_checkpoint(job.pid, mode, gpu, job))
        _, after, bad = _ask(job, "check")
        same = "same" if after == ready[1] and bad == "0" else f"DIFFERENT ({after}, {bad} bad)"
        rate = gib * (1 << 30) / took / 1e9
        return (f"| {gib:g} | {mode} | {d['active']} | **{took:.2f}** | {rate:.2f} | "
                f"{d['staged_gb']:.1f} | {d['resident_gb']:.1f} | "
                f"{int(d.get('prefault_bytes', 0)) / 1e9:.1f} | {d.get('prefault_first_s', '—')} | "  # type: ignore[call-overload]
                f"{d.get('restore_s', '—')} | {same} |")  # fmt: skip
    finally:
        job.kill()
        job.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[4.0])
    ap.add_argument("--modes", nargs="+", default=["none", "prefault", "none", "prefault"])
    ap.add_argument("--cpu", action="store_true", help="no GPU: a thread of the job stages")
    args = ap.parse_args()
    if not args.cpu:
        from spotguard.checkpoint.cuda import warm

        w = warm()
        if not w.driver:
            print(f"no GPU checkpoint API: {w.reason}", file=sys.stderr)
            return 1
    from spotguard.sizing import thp_status

    print(f"THP {thp_status().enabled}", flush=True)
    print("| GiB | mode | prefault ran | driver checkpoint s | GB/s | staged GB | resident GB | "
          "GB read ahead | range "
          "seen after s | driver restore s | data |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for gib in args.gib:
        for mode in args.modes:
            print(run(gib, mode, not args.cpu), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
