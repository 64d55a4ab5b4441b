"""A 2-rank torch.distributed job over gloo on CPU (torch.multiprocessing.spawn, rendezvous
over TCP on 127.0.0.1:PORT): each step all-reduces a small tensor; rank 0 prints one line
per step and ``done`` at the end. Its output depends only on its arguments.

``python gloo_job.py PORT STEPS STEP_SECONDS``
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, port: int, steps: int, step_seconds: float) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    total = torch.zeros(4, dtype=torch.float64)
    for i in range(1, steps + 1):
        x = torch.arange(4, dtype=torch.float64) * (rank + 1) + i
        dist.all_reduce(x)
        total += x
        if rank == 0:
            print(f"step {i} {x.tolist()} {total.tolist()}", flush=True)
        time.sleep(step_seconds)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    port, steps, step_seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    mp.spawn(run, args=(port, steps, step_seconds), nprocs=2)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
