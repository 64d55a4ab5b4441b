"""Park / unpark benchmark: how long a model server takes to give its GPU back and to answer
again, to memory and through wake-on-connect.

A small HTTP server (``spotguard run``, no change to it) holds SIZE GiB — PyTorch tensors on
the GPU with ``--gpu``, a Python buffer otherwise — and answers ``GET /`` with a checksum it
computes over that memory (on the GPU, so an answer proves the GPU state is back). For each
size:

1. **park** (to memory): wall time of :func:`spotguard.park.core.park`, GPU memory the
   process held before and after (NVML);
2. **unpark → first answer**: from the start of the unpark until the server's first answer;
3. **wake → first answer**: parked again with wake-on-connect, a client connects: from the
   connect until its answer (the listener unparks and relays);
4. the checksum after each must equal the one before.

Run: ``python -m bench.park --sizes 8 --gpu`` (needs root, CRIU, a GPU and PyTorch) or
``python -m bench.park --sizes 0.5`` (CPU). Prints one table; ``--json`` prints rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.operations import engine_for
from spotguard.park import core, gpu, record, waker
from spotguard.park.settings import ParkSettings

SERVER = """
import hashlib, http.server, sys
gib = float(sys.argv[2])
use_gpu = sys.argv[3] == "gpu"
if use_gpu:
    import torch
    n = int(gib * (1 << 30)) // 2
    g = torch.Generator(device="cuda").manual_seed(7)
    weights = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    def checksum():  # in slices: a float copy of all the weights would hold 2x their size
        total = sum(float(weights[i : i + (1 << 26)].double().sum()) for i in range(0, n, 1 << 26))
        torch.cuda.empty_cache()  # the server holds its weights, not the allocator's cache
        return repr(total)
else:
    weights = bytearray(int(gib * (1 << 30)))
    for i in range(0, len(weights), 4096):
        weights[i] = i % 251
    def checksum():
        return hashlib.blake2b(weights[::4096]).hexdigest()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = checksum().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print("ready", flush=True)
srv.serve_forever()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, timeout: float = 300.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=timeout) as r:
        return str(r.read().decode())


async def _ready(job: JobInfo, limit: float = 600.0) -> None:
    out = job.dir / "stdout"
    deadline = time.monotonic() + limit
    while not (out.exists() and "ready" in out.read_text()):
        if not proctree.alive(job.pid) or time.monotonic() > deadline:
            err = (job.dir / "stderr").read_text()[-2000:]
            raise SystemExit(f"server did not start: {err}")
        await asyncio.sleep(0.1)


async def one(size: float, use_gpu: bool, root: Path) -> dict[str, Any]:
    cs = CheckpointSettings(state_dir=root / "state", criu=os.environ.get("SPOTGUARD_CRIU"))
    ps = ParkSettings(memory_dir=Path("/dev/shm/spotguard-bench-park"))
    engine = engine_for(cs)
    port = _port()
    script = root / "server.py"
    script.write_text(SERVER)
    argv = [sys.executable, str(script), str(port), str(size), "gpu" if use_gpu else "cpu"]
    job = await start_job(argv, f"srv-{port}", state_dir=cs.state_dir, pid_namespace=True)
    row: dict[str, Any] = {"size_gib": size, "gpu": use_gpu}
    try:
        await _ready(job)
        before = await asyncio.to_thread(_get, port)
        tree = proctree.tree(job.pid)
        row["gpu_mib_before"] = gpu.used_bytes(tree) >> 20
        t0 = time.monotonic()
        rec = await core.park(job, to="memory", engine=engine, settings=cs, park_settings=ps)
        row["park_s"] = round(time.monotonic() - t0, 3)
        row["gpu_mib_parked"] = gpu.used_bytes(tree) >> 20
        row["image_mib"] = rec.bytes >> 20
        t0 = time.monotonic()
        await core.unpark(job.name, engine=engine, settings=cs, park_settings=ps)
        row["unpark_s"] = round(time.monotonic() - t0, 3)
        after = await asyncio.to_thread(_get, port)
        row["unpark_to_answer_s"] = round(time.monotonic() - t0, 3)
        row["same_after_unpark"] = after == before
        job = _reload(cs, job)
        await core.park(
            job, to="memory", engine=engine, settings=cs, park_settings=ps, wake_on_connect=True
        )
        await asyncio.to_thread(waker.spawn, cs.state_dir, job.name, None)
        t0 = time.monotonic()
        woken = await asyncio.to_thread(_get, port)
        row["wake_to_answer_s"] = round(time.monotonic() - t0, 3)
        row["same_after_wake"] = woken == before
        job = _reload(cs, job)
    finally:
        rec2 = record.load(cs.state_dir, job.name)
        if rec2 is not None and rec2.waker_pid and proctree.alive(rec2.waker_pid):
            os.kill(rec2.waker_pid, signal.SIGKILL)
        job = _reload(cs, job)
        if proctree.alive(job.pid):
            proctree.signal_all([job.pid], signal.SIGKILL)
        await asyncio.to_thread(shutil.rmtree, ps.memory_dir, True)
    return row


def _reload(cs: CheckpointSettings, job: JobInfo) -> JobInfo:
    from spotguard.checkpoint.jobs import resolve_job

    for _ in range(100):
        try:
            return resolve_job(job.name, state_dir=cs.state_dir)
        except Exception:  # noqa: BLE001 - job.json is rewritten at restore; try again
            time.sleep(0.05)
    return job


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.5])
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="sg-park-") as tmp:
            rows.append(asyncio.run(one(size, args.gpu, Path(tmp))))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"park benchmark — {platform.node()}, {os.cpu_count()} cpus")
    cols = (
        "size_gib", "gpu_mib_before", "gpu_mib_parked", "image_mib", "park_s", "unpark_s",
        "unpark_to_answer_s", "wake_to_answer_s", "same_after_unpark", "same_after_wake",
    )  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")


if __name__ == "__main__":
    main()
