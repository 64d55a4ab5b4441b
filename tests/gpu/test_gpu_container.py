"""A PyTorch job in a podman or a containerd container, its GPU devices passed in, through a
leave-running checkpoint, a park in memory (the GPU freed), an exit checkpoint into a store
and a restore as a new container: the driver's checkpoint is ordered around the runtime's
(spotguard.container.gpu), and what the job writes is byte-identical to an uninterrupted run
of the same program on the host. The same scenario, the same spotguard commands, for both
runtimes (``[podman]``, ``[containerd]``); the CPU tests with the driver double show the order
for docker and containerd (tests/container/test_*_gpu.py).

Needs an NVIDIA GPU and the runtime from scripts/install-podman or scripts/install-containerd
(offline: ``SPOTGUARD_PODMAN_DEBS`` / ``SPOTGUARD_CONTAINERD_DEBS`` with the Debian packages;
a runtime that cannot be installed skips its case, saying why). containerd runs as a daemon of
the test's own (own root, state and socket under /tmp, as in tests/container). The
container's image is an empty root whose /usr, /etc and /opt/torch are the host's, bound
read-only (no registry here), so PyTorch and the driver's libraries are the host's own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sgtest import wait_for
from spotguard.checkpoint.cuda import driver_available, inventory
from spotguard.container.containerd_vm import ContainerdVm, image_layout

pytestmark = pytest.mark.gpu

SG = [sys.executable, "-c", "import sys; from spotguard.cli import main; sys.exit(main())"]
ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1"}
STEPS = 400
#: seconds between the container's steps: it must outlive every step of the test up to the
#: exit checkpoint (containerd's leave-running alone took 35 s on an H200: its checkpoint
#: leaves the runtime as content blobs, exported before the upload)
STEP_S = 0.3
IMAGE = "localhost/sg-gpu:1"
#: the containerd case's namespace
NS = "gpu"
JOB = """
import faulthandler, sys, time, torch
out, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
sys.stderr = open(out + ".err", "a", buffering=1)  # the container's own stdio goes nowhere
faulthandler.enable(sys.stderr)
torch.manual_seed(0)
x = torch.randn(2048, 2048, device="cuda")
w = torch.randn(2048, 2048, device="cuda") / 48
hold = torch.ones(256 << 20, device="cuda")  # 1 GiB more on the GPU
with open(out, "a", buffering=1) as f:
    for i in range(steps):
        x = torch.tanh(x @ w)
        f.write(f"{i} {float(x.double().sum()):.6f} {float(hold[i]):.1f}\\n")
        time.sleep(pause)
"""


class Runtime:
    """spotguard and one container runtime with storage of the test's own; ``job``: the
    container as spotguard names it."""

    job: str
    env: dict[str, str]

    def sg(self, *args: str) -> dict[str, Any]:
        done = subprocess.run([*SG, *args], env=self.env, capture_output=True, text=True,
                              timeout=600, check=False)  # fmt: skip
        if done.returncode != 0:
            logs = sorted(set(re.findall(r"log file: (/\S+?\.log)", done.stderr)))
            tails = "".join(f"\n--- {f}:\n{_tail(Path(f))}" for f in logs)
            pytest.fail(f"spotguard {' '.join(args[:3])} failed: {done.stderr[-3000:]}{tails}")
        out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return out

    def status(self) -> str:
        """running, paused, exited, ... or absent."""
        raise NotImplementedError

    def leftovers(self) -> list[str]:
        """Copies of a restored checkpoint the runtime left on the host (containerd's)."""
        return []


class Podman(Runtime):
    """spotguard and podman with storage of the test's own."""

    job = "podman:sggpu"

    def __init__(self, root: Path, short: Path, podman: str, criu: str) -> None:
        # podman wants a runroot of at most 50 characters: storage under a short path
        self.podman = podman
        self.storage = ["--root", str(short / "storage"), "--runroot", str(short / "run")]
        self.env = {**os.environ, **ENV, "SPOTGUARD_STATE_DIR": str(root / "state"),
                    "SPOTGUARD_CRIU": criu, "SPOTGUARD_CONTAINER_PODMAN": podman,
                    "SPOTGUARD_CONTAINER_ROOT": str(short / "storage"),
                    "SPOTGUARD_CONTAINER_RUNROOT": str(short / "run")}  # fmt: skip

    def cmd(self, *args: str, stdin: bytes | None = None) -> str:
        done = subprocess.run([self.podman, *self.storage, *args], input=stdin,
                              capture_output=True, timeout=120, check=False)  # fmt: skip
        if done.returncode != 0:
            pytest.fail(f"podman {args[0]} failed: {done.stderr.decode()[-2000:]}")
        return done.stdout.decode()

    def status(self) -> str:
        done = subprocess.run([self.podman, *self.storage, "container", "inspect", "sggpu",
                               "--format", "{{.State.Status}}"], capture_output=True, text=True,
                              timeout=60, check=False)  # fmt: skip
        return done.stdout.strip() if done.returncode == 0 else "absent"


class Containerd(Runtime):
    """spotguard and a containerd daemon of the test's own."""

    job = f"containerd:{NS}/sggpu"

    def __init__(self, root: Path, vm: ContainerdVm) -> None:
        self.vm = vm
        self.env = {**os.environ, **ENV, **vm.env(), "SPOTGUARD_STATE_DIR": str(root / "state")}

    def leftovers(self) -> list[str]:
        return sorted(p.name for p in self.vm.runtime_dir.glob("ctrd-checkpoint*"))

    def status(self) -> str:
        if "sggpu" not in self.vm.ctr("containers", "ls", "-q", ns=NS).split():
            return "absent"
        for line in self.vm.ctr("tasks", "ls", ns=NS).splitlines()[1:]:
            cols = line.split()
            if cols[:1] == ["sggpu"]:
                return {"STOPPED": "exited"}.get(cols[2], cols[2].lower())
        return "created"


def _install(script: str, debs: str) -> str:
    """``scripts/SCRIPT``'s last line (the installed tool); skips, saying why, when it fails."""
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([str(repo / "scripts" / script)], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"{script} failed here (offline: set {debs}): {done.stderr.strip()[-300:]}")
    return done.stdout.strip().splitlines()[-1]


def _rootfs(tmp_path: Path) -> bytes:
    """The image: an empty root (the host's /usr, /etc and /opt/torch are bound in)."""
    root = tmp_path / "rootfs"
    for d in ("usr", "etc", "opt/torch", "tmp", "proc", "sys", "dev", "out", "var/tmp"):
        (root / d).mkdir(parents=True)
    for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"),
                         ("sbin", "usr/sbin")):  # fmt: skip
        (root / link).symlink_to(target)
    tar = subprocess.run(["tar", "-C", str(root), "-c", "."], capture_output=True, check=True)
    return tar.stdout


@pytest.fixture(params=["podman", "containerd"])
def pm(request: pytest.FixtureRequest, tmp_path: Path, criu_bin: str) -> Iterator[Runtime]:
    if not driver_available() or not inventory().count:
        pytest.skip("needs an NVIDIA GPU with the driver checkpoint API (driver r570+)")
    if request.param == "containerd":
        _install("install-containerd", "SPOTGUARD_CONTAINERD_DEBS")
        base = Path(tempfile.mkdtemp(prefix="sgc-", dir="/tmp"))  # short: socket paths
        vm = ContainerdVm.start(base / "vm", criu_bin)
        try:
            rootfs = tmp_path / "rootfs.tar"
            rootfs.write_bytes(_rootfs(tmp_path))
            vm.ctr("images", "import", str(image_layout(rootfs, base / "image.tar", IMAGE)), ns=NS)
            yield Containerd(tmp_path, vm)
        finally:
            vm.stop()
            shutil.rmtree(base, ignore_errors=True)
        return
    short = Path(tempfile.mkdtemp(prefix="sgp-", dir="/tmp"))
    p = Podman(tmp_path, short, _install("install-podman", "SPOTGUARD_PODMAN_DEBS"), criu_bin)
    p.cmd("import", "-", IMAGE, stdin=_rootfs(tmp_path))
    yield p
    subprocess.run([p.podman, *p.storage, "rm", "-f", "-a"], capture_output=True, timeout=120)
    subprocess.run([p.podman, *p.storage, "system", "reset", "-f"], capture_output=True,
                   timeout=120)  # fmt: skip
    shutil.rmtree(short, ignore_errors=True)


def _host_binds() -> list[str]:
    """The host's /usr, /etc and /opt/torch, read-only, each mount on its own (not podman's
    default recursive bind: a GPU VM mounts its driver under /usr/local/nvidia, and CRIU
    refuses a mount inside a bind that is not one the runtime named)."""
    tops = ("/usr", "/etc", "/opt/torch")
    points = {
        line.split()[1]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if any(line.split()[1].startswith(t + "/") for t in tops)
    }
    return [f"{m}:{m}:ro,bind" for m in (*tops, *sorted(points))]


def _tail(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of CRIU's log (what failed, when podman only says that it did)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as exc:
        return f"(unreadable: {exc})"


def _gpu_mib() -> int:
    """GPU memory in use on the first GPU, MiB (as nvidia-smi reports it)."""
    argv = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
    return int(out.stdout.strip().splitlines()[0])


def _why_not_running(out: Path, result: dict[str, Any]) -> str:
    """What the job and the kernel said, for a container that should be running."""
    kernel = subprocess.run(["dmesg"], capture_output=True, text=True, check=False).stdout
    return (f"{len(_lines(out / 'out.txt'))} steps written; timeline {_steps(result)}; the "
            f"job's stderr:\n{_tail(out / 'out.txt.err')}\nkernel:\n"
            f"{chr(10).join(kernel.splitlines()[-15:])}")  # fmt: skip


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _steps(result: dict[str, Any]) -> dict[str, float]:
    return {t["name"]: round(t.get("seconds") or 0.0, 2) for t in result["timeline"]}


def test_a_pytorch_container_through_leave_running_exit_and_restore(
    pm: Runtime, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "job.py").write_text(JOB)
    job = [sys.executable, str(out / "job.py"), str(tmp_path / "ref.txt"), str(STEPS), "0"]
    ref = subprocess.run(job, env={**os.environ, **ENV}, timeout=300, check=True)
    assert ref.returncode == 0
    devices = [d for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm",
                           "/dev/nvidia-uvm-tools") if os.path.exists(d)]  # fmt: skip
    argv = ["run", "--container", pm.job, "--json"]
    for d in devices:
        argv += ["--device", d]
    for v in _host_binds():
        argv += ["-v", v]
    argv += ["-v", f"{out}:/out"]
    for k, v in ENV.items():
        argv += ["-e", f"{k}={v}"]
    argv += ["--", IMAGE, sys.executable, "/out/job.py", "/out/out.txt", str(STEPS), str(STEP_S)]
    pm.sg(*argv)
    wait_for(
        lambda: len(_lines(out / "out.txt")) >= 20,
        "20 steps in the container",
        limit=240,
        every=0.2,
    )

    store = (tmp_path / "store").as_uri()
    paused = pm.sg("checkpoint", pm.job, "--to", store, "--leave-running", "--json")
    seen = _steps(paused)
    assert "gpu_checkpoint" in seen and "gpu_restore" in seen, seen
    time.sleep(1.0)  # a job the pause broke has ended by now
    assert pm.status() == "running", _why_not_running(out, paused)
    n = len(_lines(out / "out.txt"))
    wait_for(
        lambda: len(_lines(out / "out.txt")) >= n + 10,
        "ten more steps after the pause",
        limit=240,
        every=0.2,
    )

    # parked in memory: its GPU memory moves into host memory, the GPU is free, no progress
    used = _gpu_mib()
    pm.sg("park", pm.job, "--to", "memory", "--json")
    freed = used - _gpu_mib()
    assert freed >= 1024, f"parking freed only {freed} MiB of the GPU"
    n = len(_lines(out / "out.txt"))
    time.sleep(1.0)
    assert len(_lines(out / "out.txt")) == n
    pm.sg("unpark", pm.job, "--json")
    wait_for(
        lambda: len(_lines(out / "out.txt")) >= n + 10,
        "ten more steps after the unpark",
        limit=240,
        every=0.2,
    )

    done = pm.sg("checkpoint", pm.job, "--to", store, "--json")
    assert "gpu_checkpoint" in _steps(done)
    assert pm.status() == "absent"  # exit mode: removed once the image is durable
    stopped_at = len(_lines(out / "out.txt"))
    assert stopped_at < STEPS

    back = pm.sg("restore", done["image_url"], "--json")
    assert "gpu_restore" in _steps(back), _steps(back)
    assert pm.leftovers() == []  # containerd's copy of the job's memory is not kept
    wait_for(
        lambda: pm.status() in ("exited", "stopped", "absent"),
        "the job to end",
        limit=300,
        every=0.2,
    )
    print(f"\ngpu container {pm.job}: park freed {freed} MiB; pause "
          f"{paused.get('pause_seconds')} s ({seen}); exit {_steps(done)}; restore "
          f"{_steps(back)}; stopped at step {stopped_at}")  # fmt: skip
    assert (out / "out.txt").read_text() == (tmp_path / "ref.txt").read_text()
