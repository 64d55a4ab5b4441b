"""A data-parallel job on N GPUs of one node: torch.distributed with NCCL, one process per
GPU (rank r on cuda:r), DistributedDataParallel over a small MLP. Every step the ranks
all-gather their loss and a float64 checksum of their weights; every rank reads them on
the host (as a training loop that logs its loss does: the ranks meet at each step) and rank 0
prints them all (exact hex), so the output shows every rank's state, byte for byte.

    python ddp_nccl.py STEPS STEP_SECONDS PORT [NGPUS]

The NCCL settings come from the environment (``spotguard run`` sets the checkpointable ones).
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, world: int, steps: int, pause: float, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)
    ).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator(device=dev).manual_seed(rank)
    mine = torch.zeros(2, dtype=torch.float64, device=dev)
    every = [torch.zeros_like(mine) for _ in range(world)]
    for step in range(steps):
        x = torch.randn(128, 512, device=dev, generator=g)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mine[0] = loss.detach().double()
        mine[1] = sum(p.detach().double().sum() for p in model.parameters())
        dist.all_gather(every, mine)
        vals = " ".join(
            f"r{r} loss {float(t[0]).hex()} w {float(t[1]).hex()}" for r, t in enumerate(every)
        )
        if rank == 0:
            print(f"step {step} {vals}", flush=True)
        time.sleep(pause)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    steps, pause, port = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    world = int(sys.argv[4]) if len(sys.argv) > 4 else torch.cuda.device_count()
    mp.spawn(run, args=(world, steps, pause, port), nprocs=world)
