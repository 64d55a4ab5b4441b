"""A fully sharded data-parallel job on N GPUs of one node: torch.distributed with NCCL, one
process per GPU (rank r on cuda:r), FSDP (``fully_shard``, FSDP2; ``FullyShardedDataParallel``
where a torch has no ``fully_shard``) over a small MLP on the default process group — one
NCCL communicator per rank, carrying every parameter all-gather and gradient reduce-scatter.
Every step the ranks all-gather their loss and rank 0 prints them all (exact hex floats); at
the end every rank's float64 checksum of its own parameter shards is all-gathered and rank 0
prints it, so the output shows every rank's state, byte for byte.

    python fsdp_nccl.py STEPS STEP_SECONDS PORT [NGPUS]

The NCCL settings come from the environment (``spotguard run`` sets them).
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def shard(model: torch.nn.Sequential, dev: torch.device) -> torch.nn.Module:
    """``model`` sharded over the default process group (no other group is made)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=dev, use_orig_params=True)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's own shard (FSDP2 parameters are DTensors)."""
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p


def run(rank: int, world: int, steps: int, pause: float, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
    ).to(dev)
    sharded = shard(model, dev)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.01)
    g = torch.Generator(device=dev).manual_seed(rank)
    mine = torch.zeros(1, dtype=torch.float64, device=dev)
    every = [torch.zeros_like(mine) for _ in range(world)]
    for step in range(steps):
        x = torch.randn(64, 512, device=dev, generator=g)
        loss = sharded(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mine[0] = loss.detach().double()
        dist.all_gather(every, mine)
        if rank == 0:
            vals = " ".join(f"r{r} {float(t[0]).hex()}" for r, t in enumerate(every))
            print(f"step {step} loss {vals}", flush=True)
        time.sleep(pause)
    mine[0] = sum(local(p.detach()).double().sum() for p in sharded.parameters())
    dist.all_gather(every, mine)
    if rank == 0:
        vals = " ".join(f"r{r} {float(t[0]).hex()}" for r, t in enumerate(every))
        print(f"weights {vals}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    steps, pause, port = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    world = int(sys.argv[4]) if len(sys.argv) > 4 else torch.cuda.device_count()
    mp.spawn(run, args=(world, steps, pause, port), nprocs=world)
