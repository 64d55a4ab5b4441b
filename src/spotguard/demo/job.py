"""A deterministic, training-like sample job for demos and tests.

It holds ``--mb`` MiB of state, updates it every step with a fixed recurrence, and prints one
line per step: the step number, a loss-like value and a running checksum of the whole
history. Two runs with the same arguments print byte-identical output, so a run that was
checkpointed, killed and restored elsewhere can be compared line by line with an
uninterrupted run. With PyTorch and a CUDA GPU present (and ``--gpu auto|yes``), the state
lives in GPU memory and the update is a small deterministic matrix computation.

Run: ``python -m spotguard.demo.job --steps 100 --step-seconds 0.1 --mb 64``
"""

from __future__ import annotations

import argparse
import hashlib
import struct
import sys
import time
from typing import Protocol


class _Model(Protocol):
    def step(self, i: int) -> float: ...


class _CpuModel:
    """State: a bytearray of ``mb`` MiB; each step rewrites a window of it deterministically."""

    def __init__(self, mb: int, seed: int) -> None:
        self.state = bytearray(mb * 1024 * 1024)
        self.x = seed & 0xFFFFFFFF
        for off in range(0, len(self.state), 4096):  # touch every page so it is really held
            self.state[off] = (off >> 12) & 0xFF

    def step(self, i: int) -> float:
        window = 64 * 1024
        n = len(self.state)
        start = (i * 7919 * 4096) % max(n - window, 1)
        acc = 0
        for k in range(0, window, 256):
            self.x = (1103515245 * self.x + 12345) & 0x7FFFFFFF
            new = (self.state[start + k] * 31 + (self.x >> 16)) & 0xFF
            self.state[start + k] = new
            acc += new
        return acc / (window / 256) / 255.0


class _GpuModel:
    """A tiny deterministic regression trained with full-batch gradient steps on the GPU."""

    def __init__(self, mb: int, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        torch.use_deterministic_algorithms(True)
        self.torch = torch
        dev = torch.device("cuda")
        n = max(int((mb * 1024 * 1024 / 4) ** 0.5), 64)
        self.w = torch.randn(n, n, device=dev) * 0.01
        self.x = torch.randn(n, 64, device=dev)
        self.y = torch.randn(n, 64, device=dev)

    def step(self, i: int) -> float:
        pred = self.w @ self.x
        err = pred - self.y
        loss = float((err * err).mean().item())
        self.w -= 1e-3 * (err @ self.x.T) / self.x.shape[1]
        return loss


def _make_model(mb: int, seed: int, gpu: str) -> tuple[_Model, str]:
    if gpu != "no":
        try:
            import torch

            if torch.cuda.is_available():
                return _GpuModel(mb, seed), "cuda"
        except ImportError:
            pass
        if gpu == "yes":
            raise SystemExit("--gpu yes: PyTorch with CUDA is not available")
    return _CpuModel(mb, seed), "cpu"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spotguard-demo-job", description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-seconds", type=float, default=0.1)
    p.add_argument("--mb", type=int, default=16, help="MiB of state to hold")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--gpu", choices=["auto", "yes", "no"], default="auto")
    args = p.parse_args(argv)

    model, device = _make_model(args.mb, args.seed, args.gpu)
    running = hashlib.sha256()
    print(f"start device={device} mb={args.mb} steps={args.steps} seed={args.seed}", flush=True)
    for i in range(1, args.steps + 1):
        loss = model.step(i)
        running.update(struct.pack("<id", i, loss))
        print(f"step {i} loss {loss:.9f} checksum {running.hexdigest()[:16]}", flush=True)
        time.sleep(args.step_seconds)
    print(f"done checksum {running.hexdigest()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
