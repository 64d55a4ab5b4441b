"""What protecting an NCCL job costs a data-parallel job (GPU machine with 2+ GPUs).

The driver checkpoint API cannot capture NCCL's P2P (CUDA IPC), SHM and NVLS transports.
``spotguard run --nccl restrict`` turns them off (``spotguard.checkpoint.nccl``: NCCL moves
data through its socket transport over loopback); ``spotguard run`` (``--nccl release``, the
default) keeps them and preloads spotguard's NCCL shim, which releases the communicators
before a freeze and rebuilds them after (``spotguard.checkpoint.ncclctl``). This measures, on
the same GPUs, with NVLink multicast off in all (the machine rule):

* ``all_reduce`` of a 256 MiB float32 tensor: median time and NCCL's bus bandwidth;
* a DDP training step (bf16 MLP of ~200 M parameters, batch 64): median step time;

with NCCL's own choices ("NCCL defaults"), with the shim preloaded (``--shim``, default: the
installed one; skipped when there is none), and with the restrictive settings. Each
configuration runs in fresh processes (NCCL reads its settings at start). With the shim, the
ranks then keep all-reducing while this process releases and rebuilds their communicators
``--cycles`` times through the shim's control sockets, as the agent does around a freeze:
the pause it adds (median seconds of the release and of the rebuild).

    python -m bench.nccl_cost [--gpus N] [--steps 30] [--cycles 5] [--repeat 3] [--shim PATH]
                            [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from spotguard.checkpoint import nccl
from spotguard.checkpoint.ncclctl import NcclControl
from spotguard.checkpoint.scan import job_environment
from spotguard.checkpoint.settings import CheckpointSettings

#: NVLink multicast stays off in every configuration (a machine rule, and not checkpointable)
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _rank(rank: int, world: int, port: int, steps: int, q: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    x = torch.ones(64 << 20, device=dev)  # 256 MiB of float32
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    ar = statistics.median(times)
    width = 8192
    layers = [torch.nn.Linear(width, width, dtype=torch.bfloat16) for _ in range(3)]
    model = torch.nn.Sequential(*layers).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    batch = torch.randn(64, width, device=dev, dtype=torch.bfloat16)
    st = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = ddp(batch).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if i >= 3:
            st.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        q.put({"allreduce_s": ar, "step_s": statistics.median(st), "params": params})
    stop = os.environ.get("BENCH_NCCL_STOP")
    if stop:  # keep NCCL busy while the parent releases and rebuilds the communicators
        y = torch.ones(1 << 20, device=dev)
        if rank == 0:
            q.put("busy")
        while not os.path.exists(stop):
            dist.all_reduce(y)
            torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _cycles(pids: list[int], n: int) -> dict[str, float]:
    """Release and rebuild the ranks' communicators ``n`` times: median seconds of each."""
    ctl = NcclControl(call_timeout=120)
    rel, reb = [], []
    for _ in range(n):
        rel.append((await ctl.release("bench", pids, 30.0)).seconds)
        reb.append((await ctl.rebuild("bench", pids)).seconds)
    return {"release_s": statistics.median(rel), "rebuild_s": statistics.median(reb)}


def measure(env: dict[str, str], world: int, steps: int, cycles: int = 0) -> dict[str, Any]:
    """One configuration in fresh processes: ``env`` replaces this process's environment;
    with ``cycles`` (the shim preloaded), the release and rebuild are timed too."""
    import asyncio
    import tempfile

    import torch.multiprocessing as mp

    saved = dict(os.environ)
    stop = Path(tempfile.mkdtemp()) / "stop"
    os.environ.clear()
    os.environ.update(env)
    if cycles:
        os.environ["BENCH_NCCL_STOP"] = str(stop)
    try:
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        procs = mp.start_processes(_rank, args=(world, _free_port(), steps, q), nprocs=world,
                                   start_method="spawn", join=False)  # fmt: skip
        out: dict[str, Any] = q.get()
        if cycles:
            assert q.get() == "busy"
            out.update(asyncio.run(_cycles(list(procs.pids()), cycles)))
            stop.touch()
        while not procs.join():
            pass
    finally:
        os.environ.clear()
        os.environ.update(saved)
    size = 256 << 20
    out["busbw_gbs"] = size * 2 * (world - 1) / world / out["allreduce_s"] / 1e9
    return out


def _interleaved(
    configs: dict[str, tuple[dict[str, str], int]], world: int, steps: int, repeat: int
) -> dict[str, dict[str, Any]]:
    """Every configuration ``repeat`` times, in turn (A B C A B C ...), so that a drift of the
    machine (clocks, temperature) weighs on all alike; per configuration the median of the
    runs, with each run's step time kept (``step_runs_s``). Release/rebuild cycles are timed in
    the first run only."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for i in range(repeat):
        for name, (env, cycles) in configs.items():
            runs[name].append(measure(env, world, steps, cycles if i == 0 else 0))
    out: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        r = dict(rs[0])
        r["allreduce_s"] = statistics.median(x["allreduce_s"] for x in rs)
        r["step_s"] = statistics.median(x["step_s"] for x in rs)
        r["busbw_gbs"] = statistics.median(x["busbw_gbs"] for x in rs)
        r["step_runs_s"] = [x["step_s"] for x in rs]
        out[name] = r
    return out


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cycles", type=int, default=5, help="release/rebuild cycles timed")
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs of every configuration, interleaved (the table: their median)",
    )
    ap.add_argument("--shim", type=Path, default=CheckpointSettings().nccl_shim)
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = ap.parse_args()
    if args.gpus < 2:
        print("nccl_cost: needs 2 or more GPUs", file=sys.stderr)
        return 2
    keep = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    base_env = {**keep, **NO_MULTICAST}
    configs: dict[str, tuple[dict[str, str], int]] = {
        "NCCL defaults (NVLS off)": (base_env, 0),
    }
    if args.shim.is_file():
        ctl = Path(tempfile.mkdtemp(prefix="nccl-ctl-"))
        shim_env = nccl.release_env(job_environment(base_env), args.shim, ctl)
        configs["spotguard run (NCCL shim)"] = (shim_env, args.cycles)
    else:
        print(f"nccl_cost: no NCCL shim at {args.shim}: that configuration is skipped")
    configs["spotguard run --nccl restrict"] = (nccl.job_env(job_environment(base_env)), 0)
    res = _interleaved(configs, args.gpus, args.steps, max(args.repeat, 1))
    base = res["NCCL defaults (NVLS off)"]
    print(f"# NCCL settings cost: {args.gpus} x {torch.cuda.get_device_name(0)}, "
          f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{base['params'] / 1e6:.0f} M parameters (bf16), medians of {args.steps} steps; "
          f"each configuration run {args.repeat} times interleaved: median of the runs "
          "(their range)")  # fmt: skip
    print("| settings | all_reduce 256 MiB ms | bus GB/s | DDP step ms | step vs defaults |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in res.items():
        lo, hi = min(r["step_runs_s"]), max(r["step_runs_s"])
        print(f"| {name} | {r['allreduce_s'] * 1e3:.2f} | {r['busbw_gbs']:.1f} | "
              f"{r['step_s'] * 1e3:.2f} ({lo * 1e3:.2f}-{hi * 1e3:.2f}) | "
              f"{r['step_s'] / base['step_s']:.3f}x |")  # fmt: skip
    for name, r in res.items():
        if "release_s" in r:
            print(f"{name}: release {r['release_s']:.3f} s, rebuild {r['rebuild_s']:.3f} s "
                  f"(medians of {args.cycles}; the pause they add to a freeze)")  # fmt: skip
    if args.json:
        print(json.dumps({"gpus": args.gpus, "results": res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
