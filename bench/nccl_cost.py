"""What NCCL's checkpointable settings cost a data-parallel job (GPU machine with 2+ GPUs).

The driver checkpoint API cannot capture NCCL's P2P (CUDA IPC), SHM and NVLS transports, so
``spotguard run`` turns them off (``spotguard.checkpoint.nccl``) and NCCL moves data through
its socket transport over loopback. This measures, on the same GPUs, with NVLink multicast
off in both (the machine rule):

* ``all_reduce`` of a 256 MiB float32 tensor: median time and NCCL's bus bandwidth;
* a DDP training step (bf16 MLP of ~200 M parameters, batch 64): median step time;

once with NCCL's own choices ("NCCL defaults") and once with the settings ``spotguard run``
gives a job. Each configuration runs in fresh processes (NCCL reads its settings at start).

    python -m bench.nccl_cost [--gpus N] [--steps 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

from spotguard.checkpoint import nccl
from spotguard.checkpoint.scan import job_environment

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
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(env: dict[str, str], world: int, steps: int) -> dict[str, Any]:
    """One configuration in fresh processes: ``env`` replaces this process's environment."""
    import torch.multiprocessing as mp

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        mp.start_processes(_rank, args=(world, _free_port(), steps, q), nprocs=world,
                           start_method="spawn")  # fmt: skip
        out: dict[str, Any] = q.get()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    size = 256 << 20
    out["busbw_gbs"] = size * 2 * (world - 1) / world / out["allreduce_s"] / 1e9
    return out


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = ap.parse_args()
    if args.gpus < 2:
        print("nccl_cost: needs 2 or more GPUs", file=sys.stderr)
        return 2
    keep = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    configs = {
        "NCCL defaults (NVLS off)": {**keep, **NO_MULTICAST},
        "spotguard run (checkpointable)": nccl.job_env(job_environment({**keep, **NO_MULTICAST})),
    }
    res = {name: measure(env, args.gpus, args.steps) for name, env in configs.items()}
    base = res["NCCL defaults (NVLS off)"]
    print(f"# NCCL settings cost: {args.gpus} x {torch.cuda.get_device_name(0)}, "
          f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{base['params'] / 1e6:.0f} M parameters (bf16), medians of {args.steps}")  # fmt: skip
    print("| settings | all_reduce 256 MiB ms | bus GB/s | DDP step ms | step vs defaults |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in res.items():
        print(f"| {name} | {r['allreduce_s'] * 1e3:.1f} | {r['busbw_gbs']:.1f} | "
              f"{r['step_s'] * 1e3:.1f} | {r['step_s'] / base['step_s']:.2f}x |")  # fmt: skip
    if args.json:
        print(json.dumps({"gpus": args.gpus, "results": res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
