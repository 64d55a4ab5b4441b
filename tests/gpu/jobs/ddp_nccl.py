"""A data-parallel job on N GPUs of one node: torch.distributed with NCCL, one process per
GPU (rank r on cuda:r), DistributedDataParallel over a small MLP. Every step the ranks
all-gather their loss and a float64 checksum of their weights; every rank reads them on
the host (as a training loop that logs its loss does: the ranks meet at each step) and rank 0
prints them all (exact hex), so the output shows every rank's state, byte for byte.

    python ddp_nccl.py STEPS STEP_SECONDS PORT [NGPUS] [--groups]

--groups: several communicators per rank, tensor x data parallel style (``dist.new_group``):
tensor-parallel groups of 2 consecutive ranks, data-parallel groups of the ranks with the same
place in theirs (on 2 GPUs, where that group would be a rank alone, one data-parallel group of
both ranks: a communicator of its own over the same ranks). DDP reduces gradients over the
data-parallel group, the model's hidden activations are all-reduced over the tensor-parallel
group at every step, and the loss all-gather runs on the world: :func:`comms_per_rank` NCCL
communicators per rank (world, tensor, data), each with collectives at every step.

The NCCL settings come from the environment (``spotguard run`` sets the checkpointable ones).
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TP = 2  # tensor-parallel group size in --groups mode


def layout(world: int) -> tuple[list[list[int]], list[list[int]]]:
    """(tensor-parallel groups, data-parallel groups) of ``world`` ranks (``world`` even)."""
    tp = [list(range(i, i + TP)) for i in range(0, world, TP)]
    dp = [list(range(j, world, TP)) for j in range(TP)]
    if world == TP:  # data-parallel groups of one rank: one group of both instead
        dp = [list(range(world))]
    return tp, dp


def comms_per_rank(groups: bool) -> int:
    """NCCL communicators each rank holds once it has run a step."""
    return 3 if groups else 1


def make_groups(rank: int, world: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (tensor-parallel, data-parallel) groups; every rank makes every group, in
    the same order, as ``dist.new_group`` requires."""
    tp_groups, dp_groups = layout(world)
    mine = {}
    for kind, groups in (("tp", tp_groups), ("dp", dp_groups)):
        for ranks in groups:
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = g
    return mine["tp"], mine["dp"]


def run(rank: int, world: int, steps: int, pause: float, port: int, groups: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    tp, dp = make_groups(rank, world) if groups else (None, None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)
    ).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank], process_group=dp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator(device=dev).manual_seed(rank)
    mine = torch.zeros(2, dtype=torch.float64, device=dev)
    every = [torch.zeros_like(mine) for _ in range(world)]
    for step in range(steps):
        x = torch.randn(128, 512, device=dev, generator=g)
        y = ddp(x)
        if tp is not None:  # the tensor-parallel group's collective (no gradient through it)
            h = y.detach().clone()
            dist.all_reduce(h, group=tp)
            y = y + 1e-3 * h
        loss = y.pow(2).mean()
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
    args = [a for a in sys.argv[1:] if a != "--groups"]
    grouped = "--groups" in sys.argv[1:]
    steps, pause, port = int(args[0]), float(args[1]), int(args[2])
    world = int(args[3]) if len(args) > 3 else torch.cuda.device_count()
    if grouped and world % TP:
        sys.exit(f"--groups needs an even number of GPUs, not {world}")
    mp.spawn(run, args=(world, steps, pause, port, grouped), nprocs=world)
