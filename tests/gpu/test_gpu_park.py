"""Park and unpark on a GPU, through the user's commands (device machine: scripts/gpu-tests).

An HTTP inference server holding a model and ~8 GB of weights-like state on the GPU is parked
to memory (NVML shows its GPU memory freed), unparked and answers the same; parked again with
wake-on-connect, the first request wakes it and is answered. A Jupyter kernel holding CUDA
tensors is parked to memory and unparked; a new client gets the same tensor checksums.

A park or unpark killed midway (issue 31 item 12): ``park --to memory`` SIGKILLed right after
the driver checkpointed the server's GPU state (the engine's faults seam holds it before
``stop``) is brought back by what a restarted agent runs at start-up (``operations.recover``,
the real driver); an ``unpark`` of it parked to disk SIGKILLed while CRIU restores (CRIU held
at ``post-restore`` by an action script) is cleaned up by the next ``spotguard unpark``.
An exit checkpoint SIGKILLed while CRIU holds the server frozen in its post-dump hook: CRIU,
which outlives its owner, resumes the server rather than kill it, and the recovery brings its
GPU state back. Each step's time is printed (docs/benchmarks.md records them).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sgtest import wait_for
from spotguard.checkpoint import proctree
from spotguard.checkpoint.cuda import driver_available, inventory
from spotguard.park import gpu

pytestmark = [pytest.mark.gpu, pytest.mark.criu]

JOBS = Path(__file__).parent / "jobs"
SG = [sys.executable, "-m", "spotguard"]
MODEL_MB = int(os.environ.get("SPOTGUARD_PARK_TEST_MB", "8192"))


@pytest.fixture(scope="module")
def gpu_ready() -> None:
    if not driver_available() or not inventory().count:
        pytest.skip("needs an NVIDIA GPU with the driver checkpoint API (driver r580+)")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Sg:
    """``spotguard`` with one state directory; remembers what to clean up."""

    def __init__(self, root: Path, criu: str) -> None:
        self.root = root
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPOTGUARD_CRIU": criu,
                    "SPOTGUARD_STATE_DIR": str(root / "state"),
                    "SPOTGUARD_PARK_MEMORY_DIR": "/dev/shm/spotguard-test-parked"}  # fmt: skip

    def __call__(self, *args: str) -> dict[str, Any]:
        argv = [*SG, args[0], "--json", *args[1:]]  # before a run's "--"
        done = subprocess.run(argv, env=self.env, capture_output=True,
                              text=True, timeout=600, check=False)  # fmt: skip
        if done.returncode != 0:
            pytest.fail(f"spotguard {' '.join(args)} failed: {done.stderr[-4000:]}")
        out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return out

    def pid(self, name: str) -> int:
        return int(
            json.loads((self.root / "state" / "jobs" / name / "job.json").read_text())["pid"]
        )


@pytest.fixture
def sg(tmp_path: Path, criu_bin: str) -> Iterator[Sg]:
    runner = Sg(tmp_path, criu_bin)
    yield runner
    for rec in (tmp_path / "state" / "parked").glob("*.json"):
        waker = json.loads(rec.read_text()).get("waker_pid")
        if waker and proctree.alive(waker):
            os.kill(waker, 9)
    for job in (tmp_path / "state" / "jobs").glob("*/job.json"):
        pid = int(json.loads(job.read_text())["pid"])
        if proctree.alive(pid):
            proctree.signal_all(proctree.tree(pid), 9)


def _get(port: int, path: str, timeout: float = 300.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return str(r.read().decode())


def test_server_parked_to_memory_frees_gpu_and_wakes_on_connect(gpu_ready: None, sg: Sg) -> None:
    port = _port()
    sg("run", "--name", "srv", "--", sys.executable, str(JOBS / "server.py"), str(port),
       str(MODEL_MB))  # fmt: skip
    wait_for(lambda: _ready(port), "the server to answer", limit=300)
    before = _get(port, "/infer?x=3")
    held = gpu.used_bytes(proctree.tree(sg.pid("srv")))
    assert held > MODEL_MB * 2**20 * 0.9
    t0 = time.monotonic()
    parked = sg("park", "srv", "--to", "memory")
    park_s = time.monotonic() - t0
    assert parked["gpu_memory_freed"] >= held * 0.9
    assert gpu.used_bytes([sg.pid("srv")]) == 0  # NVML: nothing held while parked
    t0 = time.monotonic()
    sg("unpark", "srv")
    after = _get(port, "/infer?x=3")
    unpark_s = time.monotonic() - t0
    assert after == before
    sg("park", "srv", "--to", "memory", "--wake-on-connect")
    t0 = time.monotonic()
    woken = _get(port, "/infer?x=3")
    wake_s = time.monotonic() - t0
    assert woken == before
    print(f"\nserver {held / 2**30:.1f} GiB on GPU: park (CLI) {park_s:.2f} s "
          f"(engine {parked['seconds']:.2f} s), unpark→answer (CLI) {unpark_s:.2f} s, "
          f"wake→answer {wake_s:.2f} s")  # fmt: skip


def _ready(port: int) -> bool:
    try:
        return _get(port, "/ready", timeout=2) == "ok"
    except OSError:
        return False


def test_jupyter_kernel_parked_to_memory_and_unparked(gpu_ready: None, sg: Sg) -> None:
    jupyter_client = pytest.importorskip("jupyter_client")
    conn = sg.root / "kernel.json"
    ports = [_port() for _ in range(5)]
    conn.write_text(json.dumps({
        "shell_port": ports[0], "iopub_port": ports[1], "stdin_port": ports[2],
        "control_port": ports[3], "hb_port": ports[4], "ip": "127.0.0.1",
        "key": secrets.token_hex(16), "transport": "tcp", "signature_scheme": "hmac-sha256",
        "kernel_name": "python3",
    }))  # fmt: skip
    sg("run", "--name", "kernel", "--", sys.executable, "-m", "ipykernel_launcher", "-f",
       str(conn))  # fmt: skip
    code = (
        "import torch; g = torch.Generator(device='cuda').manual_seed(11); "
        "t = torch.randn(64 << 20, device='cuda', generator=g); "
        "print(repr(float(t.double().sum())))"
    )
    first = _run_cell(jupyter_client, conn, code)
    check = "print(repr(float(t.double().sum())))"
    parked = sg("park", "kernel", "--to", "memory", "--reason", "notebook idle")
    assert parked["gpu_memory_freed"] > 0
    assert gpu.used_bytes([sg.pid("kernel")]) == 0  # suspended in place: GPU memory freed
    sg("unpark", "kernel")
    again = _run_cell(jupyter_client, conn, check)  # a new client reconnects
    assert again == first
    print(
        f"\nkernel: same tensor checksum after park/unpark ({first}); "
        f"park {parked['seconds']:.2f} s, {parked['gpu_memory_freed'] / 2**20:.0f} MiB freed"
    )


def _run_cell(jupyter_client: Any, conn: Path, code: str) -> str:
    client = jupyter_client.BlockingKernelClient(connection_file=str(conn))
    client.load_connection_file()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        out: list[str] = []
        client.execute_interactive(
            code, timeout=300,
            output_hook=lambda m: out.append(m["content"].get("text", ""))
            if m["msg_type"] == "stream" else None,
        )  # fmt: skip
        return "".join(out).strip()
    finally:
        client.stop_channels()


# --- a park or unpark killed midway (issue 31 item 12) ------------------------------------

KILL_MB = int(os.environ.get("SPOTGUARD_PARK_KILL_TEST_MB", "1024"))

PARK_HELD = textwrap.dedent(
    """
    import asyncio, sys
    from spotguard.checkpoint.jobs import resolve_job
    from spotguard.checkpoint.settings import CheckpointSettings
    from spotguard.config import load
    from spotguard.operations import engine_for
    from spotguard.park import core
    from spotguard.park.settings import ParkSettings

    class HoldAt:
        async def before(self, step):
            if step == sys.argv[1]:
                print("at", step, flush=True)
                await asyncio.sleep(3600)

    async def main():
        cs, ps = load(CheckpointSettings, {}), load(ParkSettings, {})
        eng = engine_for(cs)
        eng.faults = HoldAt()
        job = resolve_job("srv", state_dir=cs.state_dir)
        await core.park(job, to="memory", engine=eng, settings=cs, park_settings=ps)

    asyncio.run(main())
    """
)

RECOVER = textwrap.dedent(
    """
    import asyncio
    from spotguard import operations
    from spotguard.checkpoint.jobs import resolve_job
    from spotguard.checkpoint.settings import CheckpointSettings
    from spotguard.config import load

    cs = load(CheckpointSettings, {})
    job = resolve_job("srv", state_dir=cs.state_dir)
    print(asyncio.run(operations.recover(job, settings=cs)), flush=True)
    """
)


CHECKPOINT_HELD = textwrap.dedent(
    """
    import asyncio, sys
    from spotguard import operations
    from spotguard.checkpoint.jobs import resolve_job
    from spotguard.checkpoint.settings import CheckpointSettings
    from spotguard.config import load
    from spotguard.image import ImageSettings
    from spotguard.modes import Mode

    class HoldAt:
        async def before(self, step):
            if step == sys.argv[1]:
                print("at", step, flush=True)
                await asyncio.sleep(3600)

    async def main():
        cs = load(CheckpointSettings, {})
        eng = operations.engine_for(cs)
        eng.faults = HoldAt()
        job = resolve_job("srv", state_dir=cs.state_dir)
        await operations.checkpoint(
            job, sys.argv[2], mode=Mode.EXIT, settings=cs,
            image_settings=load(ImageSettings, {}), engine=eng,
        )

    asyncio.run(main())
    """
)


def _server(sg: Sg) -> tuple[int, str]:
    port = _port()
    sg(
        "run",
        "--name",
        "srv",
        "--",
        sys.executable,
        str(JOBS / "server.py"),
        str(port),
        str(KILL_MB),
    )
    wait_for(lambda: _ready(port), "the server to answer", limit=300)
    return port, _get(port, "/infer?x=3")


def test_a_park_in_place_killed_after_the_gpu_checkpoint_is_recovered(
    gpu_ready: None, sg: Sg
) -> None:
    port, before = _server(sg)
    pid = sg.pid("srv")
    child = subprocess.Popen(
        [sys.executable, "-c", PARK_HELD, "stop"],
        env=sg.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stderr is not None
    line = child.stdout.readline().strip()
    if line != "at stop":
        child.kill()
        pytest.fail(f"the park never reached its stop step: {line!r} {child.stderr.read()!r}")
    # the server is the job's init's child: the GPU memory is the tree's
    assert gpu.used_bytes(proctree.tree(pid)) == 0  # the driver holds it in host memory now
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (sg.root / "state" / "jobs" / "srv" / "operation.json").exists()
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", RECOVER], env=sg.env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.stdout.strip() == "True", done.stderr[-4000:]
    recover_s = time.monotonic() - t0
    assert _get(port, "/infer?x=3") == before
    assert gpu.used_bytes(proctree.tree(pid)) > KILL_MB * 2**20 * 0.9
    sg("park", "srv", "--to", "memory")
    sg("unpark", "srv")
    assert _get(port, "/infer?x=3") == before
    print(
        f"\nrecovered a park killed after the GPU checkpoint ({KILL_MB} MiB) in {recover_s:.2f} s"
    )


def test_a_checkpoint_killed_while_criu_holds_the_server_leaves_it_serving(
    gpu_ready: None, sg: Sg, tmp_path: Path
) -> None:
    """An exit checkpoint of the GPU server SIGKILLed while CRIU holds the tree frozen (the
    faults seam holds the engine in CRIU's post-dump hook, the image written): CRIU outlives
    it, finds its owner gone, and resumes the server instead of killing it; the recovery a
    restarted agent runs waits for CRIU to let go and brings the GPU state back. The server
    answers the same, holds its GPU memory again, and parks and unparks afterwards."""
    port, before = _server(sg)
    pid = sg.pid("srv")
    store = f"file://{tmp_path / 'store'}"
    child = subprocess.Popen(
        [sys.executable, "-c", CHECKPOINT_HELD, "capture_files", store],
        env=sg.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert child.stdout is not None and child.stderr is not None
    line = child.stdout.readline().strip()
    if line != "at capture_files":
        child.kill()
        pytest.fail(f"the checkpoint never reached capture_files: {line!r} {child.stderr.read()!r}")
    tree = proctree.tree(pid)
    assert proctree.tracers(tree), "CRIU does not hold the server"
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", RECOVER], env=sg.env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.stdout.strip() == "True", done.stderr[-4000:]
    recover_s = time.monotonic() - t0
    assert proctree.alive(pid) and not proctree.tracers(proctree.tree(pid))
    assert _get(port, "/infer?x=3") == before
    assert gpu.used_bytes(proctree.tree(pid)) > KILL_MB * 2**20 * 0.9
    sg("park", "srv", "--to", "memory")
    sg("unpark", "srv")
    assert _get(port, "/infer?x=3") == before
    print(
        f"\nrecovered a checkpoint killed in CRIU's post-dump ({KILL_MB} MiB) in {recover_s:.2f} s"
    )


def test_an_unpark_killed_while_criu_restores_is_cleaned_by_the_next_unpark(
    gpu_ready: None, sg: Sg, tmp_path: Path
) -> None:
    port, before = _server(sg)
    sg("park", "srv", "--to", "disk")
    reached = tmp_path / "criu-reached"
    script = tmp_path / "criu-action.sh"
    script.write_text(
        f'#!/bin/sh\nif [ "$CRTOOLS_SCRIPT_ACTION" = "post-restore" ]; then\n'
        f"  echo $$ > {reached}.tmp && mv {reached}.tmp {reached}\n  exec sleep 3600\nfi\n"
    )
    script.chmod(0o755)
    conf = tmp_path / "criu.conf"
    conf.write_text(f"action-script {script}\n")
    child = subprocess.Popen([*(sys.executable, "-m", "spotguard"), "unpark", "srv"],
                             env={**sg.env, "CRIU_CONFIG_FILE": str(conf)})  # fmt: skip
    wait_for(
        lambda: reached.exists() or child.poll() is not None,
        "CRIU to reach post-restore",
        limit=300,
    )
    assert reached.exists(), "the unpark ended before CRIU reached post-restore"
    child.send_signal(signal.SIGKILL)
    child.wait()
    os.kill(int(reached.read_text()), signal.SIGKILL)  # the action script's sleep
    sg("unpark", "srv")
    assert _get(port, "/infer?x=3") == before
    pid = sg.pid("srv")
    assert proctree.alive(pid)
