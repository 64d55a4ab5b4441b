"""Real jobs on a GPU, unchanged, through the user's commands (device machine: scripts/gpu-tests).

Each job is started with ``spotguard run`` (own PID and mount namespaces), checkpointed
leave-running, then checkpointed with exit (parked), restored on the same node at once
(unparked), and must give what an uninterrupted run gives, byte for byte:

(a) a small transformer trainer (AdamW, bf16 autocast) whose DataLoader has 2 fork workers
    and pinned memory; (b) an HTTP inference server holding a model on the GPU (GPU memory
    freed while parked, as NVML shows); (c) a Jupyter kernel holding CUDA tensors, driven by
    jupyter_client (a new client after the restore gets the same checksums); (d) a 2-process
    torch.distributed (gloo) job sharing the GPU.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sgtest import free_port, wait_for
from spotguard.checkpoint import proctree
from spotguard.checkpoint.cuda import driver_available, inventory

pytestmark = [pytest.mark.gpu, pytest.mark.criu]

JOBS = Path(__file__).parent / "jobs"
SG = [sys.executable, "-c", "import sys; from spotguard.cli import main; sys.exit(main())"]
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def gpu_ready() -> None:
    if not driver_available() or not inventory().count:
        pytest.skip("needs an NVIDIA GPU with the driver checkpoint API (driver r570+)")


class Spotguard:
    """The ``spotguard`` command with one state directory."""

    def __init__(self, root: Path, criu: str, extra_env: dict[str, str] | None = None) -> None:
        self.root = root
        self.env = {**os.environ, **DETERMINISTIC, "SPOTGUARD_STATE_DIR": str(root / "state"),
                    "SPOTGUARD_CRIU": criu, **(extra_env or {})}  # fmt: skip
        self.pids: list[int] = []

    def __call__(self, *args: str) -> dict[str, Any]:
        done = subprocess.run([*SG, *args, "--json"], env=self.env, capture_output=True,
                              text=True, timeout=600, check=False)  # fmt: skip
        if done.returncode != 0:
            pytest.fail(f"spotguard {' '.join(args)} failed: {done.stderr[-4000:]}")
        out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        if "pid" in out:
            self.pids.append(int(out["pid"]))
        return out

    def run(self, name: str, argv: list[str]) -> dict[str, Any]:
        # `--json` must come before `--`: place it by hand
        done = subprocess.run([*SG, "run", "--name", name, "--json", "--", *argv],
                              env=self.env, capture_output=True, text=True, timeout=60,
                              check=False)  # fmt: skip
        if done.returncode != 0:
            pytest.fail(f"spotguard run failed: {done.stderr[-2000:]}")
        out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        self.pids.append(int(out["pid"]))
        return out

    def steps(self, result: dict[str, Any]) -> str:
        """Each step's seconds; ``[placed]`` after a restore's GPU memory that was placed
        while the driver restored (``[checkpoint] restore_overlap``)."""
        return ", ".join(
            f"{t['name']} {t['seconds']:.2f}"
            + (" [placed]" if (t.get("detail") or {}).get("overlap") else "")
            + (f" [not placed: {d['overlap_refused']}]"
               if (d := t.get("detail") or {}).get("overlap_refused") else "")
            for t in result["timeline"] if t.get("seconds")
        )  # fmt: skip

    def kill_all(self) -> None:
        for p in self.pids:
            if proctree.alive(p):
                proctree.signal_all(proctree.tree(p)[::-1], __import__("signal").SIGKILL)


@pytest.fixture
def sg(tmp_path: Path, criu_bin: str) -> Iterator[Spotguard]:
    s = Spotguard(tmp_path, criu_bin)
    yield s
    s.kill_all()


def wait(cond: Callable[[], bool], what: str, limit: float = 180.0) -> None:
    """:func:`sgtest.wait_for` with this module's limit and pace (the GPU tests share it)."""
    wait_for(cond, what, limit, every=0.1)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def gpu_mib_used() -> int:
    """GPU memory all compute processes hold, by NVML."""
    import pynvml

    pynvml.nvmlInit()
    total = 0
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        total += sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h))
    return total >> 20


def park_unpark_batch_job(
    sg: Spotguard, name: str, argv: list[str], steps: int, env: dict[str, str] | None = None
) -> None:
    """Reference run, then run → leave-running checkpoint → exit checkpoint → restore; the
    restored job's whole stdout must equal the reference."""
    ref = subprocess.run(argv, env={**sg.env, **(env or {})}, capture_output=True, text=True,
                         timeout=600, check=True).stdout.splitlines()  # fmt: skip
    assert len(ref) == steps
    job = sg.run(name, argv)
    out = Path(job["dir"]) / "stdout"
    err = Path(job["dir"]) / "stderr"
    try:
        wait(lambda: len(lines(out)) >= 5, f"{name} to start")
        paused = sg("checkpoint", name, "--to", str(sg.root / "img-pause"), "--leave-running")
        assert paused["gpu_pids"], "no GPU process found"
        n = len(lines(out))
        wait(lambda: len(lines(out)) > n + 3, f"{name} to go on after the pause")
        parked = sg("checkpoint", name, "--to", str(sg.root / "img-park"))
        wait(lambda: not proctree.alive(job["pid"]), f"{name} to stop")
        assert len(lines(out)) < steps, "the job ended before it was parked"
        restored = sg("restore", str(sg.root / "img-park"))
        print(f"\n{name}: pause {paused['pause_seconds']:.2f} s ({sg.steps(paused)}); "
              f"park: {sg.steps(parked)}; unpark: {sg.steps(restored)}")  # fmt: skip
        wait(lambda: (Path(job["dir"]) / "exit_status").exists(), f"{name} to finish", 600)
        assert (Path(job["dir"]) / "exit_status").read_text().strip() == "0", err.read_text()
        assert lines(out) == ref
        print(f"{name}: output byte-identical to an uninterrupted run ({len(ref)} lines)")
    except BaseException:
        print(f"{name} stderr:", err.read_text()[-3000:] if err.exists() else "(none)")
        raise


def test_a_trainer_with_fork_workers_and_pinned_memory(gpu_ready: None, sg: Spotguard) -> None:
    argv = [sys.executable, str(JOBS / "trainer.py"), "120", "0.05"]
    park_unpark_batch_job(sg, "trainer", argv, 120)


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
        return str(r.read().decode())


def test_an_inference_server_parked_frees_the_gpu_and_answers_the_same(
    gpu_ready: None, sg: Spotguard
) -> None:
    port = free_port()
    job = sg.run("server", [sys.executable, str(JOBS / "server.py"), str(port), "2048"])

    def ready() -> bool:
        try:
            return _get(port, "/ready") == "ok"
        except OSError:
            return False

    wait(ready, "the server")
    before = [_get(port, f"/infer?x={n}") for n in range(5)]
    held = gpu_mib_used()
    assert held >= 2048
    sg("checkpoint", "server", "--to", str(sg.root / "img-pause"), "--leave-running")
    assert [_get(port, f"/infer?x={n}") for n in range(5)] == before
    parked = sg("checkpoint", "server", "--to", str(sg.root / "img-park"))
    wait(lambda: not proctree.alive(job["pid"]), "the server to stop")
    freed = gpu_mib_used()
    assert freed == 0, f"{freed} MiB still held while parked"
    restored = sg("restore", str(sg.root / "img-park"))
    assert [_get(port, f"/infer?x={n}") for n in range(5)] == before
    print(f"\nserver: {held} MiB on the GPU -> {freed} MiB parked; park: {sg.steps(parked)}; "
          f"unpark: {sg.steps(restored)}; same answers")  # fmt: skip


KERNEL_SETUP = """
import torch, hashlib
torch.manual_seed(0)
a = torch.randn(4096, 4096, device="cuda")
b = (a @ a.T).relu()
def check():
    return hashlib.sha256(b.cpu().numpy().tobytes()).hexdigest()[:16] + " " + repr(float(a.sum()))
print(check())
"""


def _execute(conn: Path, code: str) -> str:
    from jupyter_client import BlockingKernelClient

    client = BlockingKernelClient(connection_file=str(conn))
    client.load_connection_file()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        out: list[str] = []
        reply = client.execute_interactive(
            code, timeout=120, output_hook=lambda m: out.append(m["content"].get("text", ""))
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(out).strip()
    finally:
        client.stop_channels()


def test_a_jupyter_kernel_holding_cuda_tensors(gpu_ready: None, sg: Spotguard) -> None:
    ports = [free_port() for _ in range(5)]
    conn = sg.root / "kernel.json"
    conn.write_text(json.dumps({
        "transport": "tcp", "ip": "127.0.0.1", "key": secrets.token_hex(16),
        "signature_scheme": "hmac-sha256", "kernel_name": "python3",
        **dict(zip(["shell_port", "iopub_port", "stdin_port", "control_port", "hb_port"],
                   ports, strict=True)),
    }))  # fmt: skip
    job = sg.run("kernel", [sys.executable, "-m", "ipykernel_launcher", "-f", str(conn)])
    first = _execute(conn, KERNEL_SETUP)
    assert len(first.split()) == 2
    time.sleep(1.0)  # let the client's connections close
    sg("checkpoint", "kernel", "--to", str(sg.root / "img-pause"), "--leave-running")
    assert _execute(conn, "print(check())") == first
    time.sleep(1.0)
    parked = sg("checkpoint", "kernel", "--to", str(sg.root / "img-park"))
    wait(lambda: not proctree.alive(job["pid"]), "the kernel to stop")
    restored = sg("restore", str(sg.root / "img-park"))
    assert _execute(conn, "print(check())") == first
    # the kernel computes on the GPU again (float64: a float32 sum of 2**24 ones may round)
    code = "print(float((a.double() + 1).sum() - a.double().sum()))"
    assert _execute(conn, code) == str(4096.0 * 4096)
    print(f"\nkernel: same tensor checksums after unpark ({first}); park: {sg.steps(parked)}; "
          f"unpark: {sg.steps(restored)}")  # fmt: skip


def test_a_two_process_gloo_job_sharing_the_gpu(
    gpu_ready: None, tmp_path: Path, criu_bin: str
) -> None:
    # established loopback TCP between the ranks: dumped with --tcp-established; no iptables
    # on these machines, so CRIU is told (through its own config file) to skip the network
    # lock — safe here, the whole tree is frozen
    cfg = tmp_path / "criu.conf"
    cfg.write_text("network-lock skip\n")
    sg = Spotguard(tmp_path, criu_bin, {"SPOTGUARD_TCP_ESTABLISHED": "true",
                                        "CRIU_CONFIG_FILE": str(cfg)})  # fmt: skip
    try:
        argv = [sys.executable, str(JOBS / "ddp_gloo.py"), "150", "0.05", str(free_port())]
        park_unpark_batch_job(sg, "ddp", argv, 150)
    finally:
        sg.kill_all()
