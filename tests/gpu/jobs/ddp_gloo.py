"""A 2-process data-parallel job on one GPU: torch.distributed with gloo over 127.0.0.1,
both ranks on the same GPU. Rank 0 prints each step's loss and the all-reduced gradient
checksum (exact hex).

    python ddp_gloo.py STEPS STEP_SECONDS PORT
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, steps: int, pause: float, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    model = torch.nn.Linear(256, 256).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator(device=dev).manual_seed(rank)
    for step in range(steps):
        x = torch.randn(64, 256, device=dev, generator=g)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        w = sum(p.detach().double().sum().item() for p in model.parameters())
        if rank == 0:
            print(f"step {step} loss {loss.item().hex()} w {w.hex()}", flush=True)
        time.sleep(pause)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    steps, pause, port = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    mp.spawn(run, args=(steps, pause, port), nprocs=2)
