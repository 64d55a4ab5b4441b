"""A small transformer trained with AdamW under bf16 autocast, fed by a DataLoader with two
forked workers and pinned memory. Prints each step's loss (exact float hex) and a checksum
of the weights every 10 steps. Deterministic: two runs print the same bytes.

    python trainer.py STEPS STEP_SECONDS
"""

import hashlib
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

SEQ, VOCAB, DIM = 64, 512, 256


class Tokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i is a function of i alone (any worker can make it)."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        return x[:-1], x[1:]


def main() -> None:
    steps, pause = int(sys.argv[1]), float(sys.argv[2])
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda")
    layer = nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.TransformerEncoder(layer, 2),
                          nn.Linear(DIM, VOCAB)).to(dev)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Tokens(), batch_size=16, shuffle=False, num_workers=2,
                        pin_memory=True, persistent_workers=True,
                        multiprocessing_context="fork")  # fmt: skip
    it = iter(loader)
    for step in range(steps):
        x, y = next(it)
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        line = f"step {step} loss {loss.float().item().hex()}"
        if step % 10 == 9:
            h = hashlib.sha256()
            for p in model.parameters():
                h.update(p.detach().float().cpu().numpy().tobytes())
            line += f" weights {h.hexdigest()[:16]}"
        print(line, flush=True)
        time.sleep(pause)


if __name__ == "__main__":
    main()
