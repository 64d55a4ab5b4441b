"""A data-parallel job on every GPU of the node (NCCL, one process per GPU), through the user's
commands — device machine with 2+ GPUs (``scripts/gpu-tests``; skipped with fewer).

The job is started with ``spotguard run`` with NCCL's default transports (P2P/NVLink and
shared memory on; NVLink multicast as the machine sets it): spotguard's NCCL shim releases
every rank's communicators before each freeze and rebuilds them after. It is checkpointed
leave-running, checkpointed with exit and restored onto its own GPUs, then
checkpointed with exit again and restored with its GPUs swapped (the image's GPU 0 onto the
host's GPU 1 and back, ``SPOTGUARD_RESTORE_GPUS``). Its whole output — every rank's loss and
weight checksum at every step — must equal an uninterrupted run's, byte for byte, and the GPUs
must hold nothing while the job is parked.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_gpu_nccl import installed_shim, nccl_step
from test_gpu_realjobs import JOBS, Spotguard, gpu_mib_used, lines, wait

from sgtest import free_port
from spotguard.checkpoint import proctree
from spotguard.checkpoint.cuda import driver_available, inventory
from spotguard.checkpoint.scan import job_environment

pytestmark = [pytest.mark.gpu, pytest.mark.criu]


@pytest.fixture(scope="module")
def gpus() -> int:
    if not driver_available() or inventory().count < 2:
        pytest.skip("needs 2 or more NVIDIA GPUs with the driver checkpoint API")
    return inventory().count


def _gpu_of(pids: list[int]) -> dict[int, str]:
    """Each process's pid inside the job's PID namespace (the same after a restore) → UUID of
    the one GPU it holds memory on, by NVML. A rank holding memory on a second GPU fails: a
    context made there by a stray current device (~500 MiB each, on a node of eight)."""
    import pynvml

    pynvml.nvmlInit()
    held: dict[int, dict[str, int]] = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        raw = pynvml.nvmlDeviceGetUUID(h)
        uuid = str(raw.decode() if isinstance(raw, bytes) else raw)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid in pids:
                used = int(p.usedGpuMemory or 0)
                held.setdefault(proctree.ns_pid(p.pid), {})[uuid] = used
    print(f"GPU memory by process (ns pid → UUID → bytes): {held}")
    assert all(len(by) == 1 for by in held.values()), f"a rank holds memory on 2 GPUs: {held}"
    return {pid: next(iter(by)) for pid, by in held.items()}


def test_a_ddp_job_on_every_gpu_survives_pause_exit_and_a_swapped_restore(
    gpus: int, tmp_path: Path, criu_bin: str
) -> None:
    steps = 260
    argv = [sys.executable, str(JOBS / "ddp_nccl.py"), str(steps), "0.05", str(free_port())]
    shim = installed_shim()
    sg = Spotguard(tmp_path, criu_bin, {"SPOTGUARD_NCCL_SHIM": str(shim)})
    # the reference runs with NCCL's own transport choices, as the protected job does
    ref_env = job_environment(sg.env)
    try:
        ref = subprocess.run(argv, env=ref_env, capture_output=True, text=True, timeout=600,
                             check=False)  # fmt: skip
        assert ref.returncode == 0, ref.stderr[-3000:]
        want = ref.stdout.splitlines()
        assert len(want) == steps
        job = sg.run("ddp", argv)
        out = Path(job["dir"]) / "stdout"
        err = Path(job["dir"]) / "stderr"
        try:
            wait(lambda: len(lines(out)) >= 5, "the DDP job to start")
            before = _gpu_of(proctree.tree(job["pid"]))
            assert len(set(before.values())) == gpus, f"ranks on {before}"
            paused = sg("checkpoint", "ddp", "--to", str(sg.root / "img-pause"), "--leave-running")
            # every rank, and the launcher if it initialised CUDA (mp.spawn's parent does)
            assert len(paused["gpu_pids"]) >= gpus, paused["gpu_pids"]
            assert nccl_step(paused, "nccl_release") >= gpus, paused["timeline"]
            assert nccl_step(paused, "nccl_rebuild") == nccl_step(paused, "nccl_release")
            n = len(lines(out))
            wait(lambda: len(lines(out)) > n + 3, "the job to go on after the pause")
            assert _gpu_of(proctree.tree(job["pid"])) == before, "ranks moved by the pause"

            parked = sg("checkpoint", "ddp", "--to", str(sg.root / "img-park"))
            wait(lambda: not proctree.alive(job["pid"]), "the job to stop")
            assert gpu_mib_used() == 0, "GPU memory still held while parked"
            assert nccl_step(parked, "nccl_release") >= gpus
            restored = sg("restore", str(sg.root / "img-park"))
            assert nccl_step(restored, "nccl_rebuild") >= gpus
            n = len(lines(out))
            wait(lambda: len(lines(out)) > n + 3, "the restored job to go on")
            same = _gpu_of(proctree.tree(restored["pid"]))
            assert sorted(same.values()) == sorted(before.values())

            again = sg("checkpoint", "ddp", "--to", str(sg.root / "img-swap"))
            wait(lambda: not proctree.alive(restored["pid"]), "the job to stop again")
            assert len(lines(out)) < steps, "the job ended before its second park"
            order = ",".join(str(i) for i in reversed(range(gpus)))
            sg.env["SPOTGUARD_RESTORE_GPUS"] = order
            swapped = sg("restore", str(sg.root / "img-swap"))
            assert nccl_step(swapped, "nccl_rebuild") >= gpus
            del sg.env["SPOTGUARD_RESTORE_GPUS"]
            n = len(lines(out))
            wait(lambda: len(lines(out)) > n + 2, "the swapped job to go on")
            moved = _gpu_of(proctree.tree(swapped["pid"]))
            # every rank (the same process: same pid in the job's namespace) is on another GPU
            assert sorted(moved) == sorted(before), (before, moved)
            by_rank_before = [before[p] for p in sorted(before)]
            by_rank_after = [moved[p] for p in sorted(moved)]
            assert by_rank_after == list(reversed(by_rank_before)), (before, moved)

            wait(lambda: (Path(job["dir"]) / "exit_status").exists(), "the job to finish", 600)
            assert (Path(job["dir"]) / "exit_status").read_text().strip() == "0", err.read_text()
            assert lines(out) == want
            print(
                f"\nddp x{gpus}: pause {paused['pause_seconds']:.2f} s ({sg.steps(paused)}); "
                f"park: {sg.steps(parked)}; unpark: {sg.steps(restored)}; "
                f"park again: {sg.steps(again)}; swapped unpark: {sg.steps(swapped)}; "
                f"output byte-identical to an uninterrupted run ({len(want)} lines); "
                f"GPUs by rank {by_rank_before} -> {by_rank_after}"
            )
        except BaseException:
            print("ddp stderr:", err.read_text()[-4000:] if err.exists() else "(none)")
            raise
    finally:
        sg.kill_all()
        time.sleep(0.5)


def _pause_exit_restore(
    tmp_path: Path, criu_bin: str, name: str, argv: list[str], want_lines: int, comms: int
) -> None:
    """Run ``argv`` under ``spotguard run`` (NCCL's default transports, the shim preloaded)
    through a leave-running checkpoint, a checkpoint with exit and a restore; its output must
    equal an uninterrupted run's byte for byte, and every freeze and restore must release and
    rebuild exactly ``comms`` communicators (all ranks together)."""
    sg = Spotguard(tmp_path, criu_bin, {"SPOTGUARD_NCCL_SHIM": str(installed_shim())})
    err = tmp_path / "none"
    try:
        ref = subprocess.run(argv, env=job_environment(sg.env), capture_output=True, text=True,
                             timeout=300, check=False)  # fmt: skip
        assert ref.returncode == 0, ref.stderr[-3000:]
        want = ref.stdout.splitlines()
        assert len(want) == want_lines, want[-3:]
        job = sg.run(name, argv)
        out = Path(job["dir"]) / "stdout"
        err = Path(job["dir"]) / "stderr"
        wait(lambda: len(lines(out)) >= 5, f"the {name} job to start")
        paused = sg("checkpoint", name, "--to", str(sg.root / "img-pause"), "--leave-running")
        counts = (nccl_step(paused, "nccl_release"), nccl_step(paused, "nccl_rebuild"))
        assert counts == (comms, comms), (counts, paused["timeline"])
        n = len(lines(out))
        wait(lambda: len(lines(out)) > n + 3, f"the {name} job to go on after the pause")

        parked = sg("checkpoint", name, "--to", str(sg.root / "img-park"))
        wait(lambda: not proctree.alive(job["pid"]), f"the {name} job to stop")
        assert len(lines(out)) < want_lines - 3, "the job ended before it was parked"
        assert gpu_mib_used() == 0, "GPU memory still held while parked"
        assert nccl_step(parked, "nccl_release") == comms, parked["timeline"]
        restored = sg("restore", str(sg.root / "img-park"))
        assert nccl_step(restored, "nccl_rebuild") == comms, restored["timeline"]

        status = Path(job["dir"]) / "exit_status"
        wait(status.exists, f"the {name} job to finish", 300)
        assert status.read_text().strip() == "0", err.read_text()[-3000:]
        assert lines(out) == want
        print(
            f"\n{name}: {comms} communicators; pause {paused['pause_seconds']:.2f} s "
            f"({sg.steps(paused)}); park: {sg.steps(parked)}; unpark: {sg.steps(restored)}; "
            f"output byte-identical to an uninterrupted run ({len(want)} lines)"
        )
    except BaseException:
        print(f"{name} stderr:", err.read_text()[-4000:] if err.exists() else "(none)")
        raise
    finally:
        sg.kill_all()
        time.sleep(0.5)


def test_an_fsdp_job_on_two_gpus_survives_pause_exit_and_restore(
    gpus: int, tmp_path: Path, criu_bin: str
) -> None:
    steps = 200
    argv = [sys.executable, str(JOBS / "fsdp_nccl.py"), str(steps), "0.05", str(free_port()), "2"]
    # FSDP's all-gathers and reduce-scatters run on the default group: one communicator a rank
    _pause_exit_restore(tmp_path, criu_bin, "fsdp", argv, steps + 1, comms=2)


def test_a_job_with_tensor_and_data_parallel_groups_survives_pause_exit_and_restore(
    gpus: int, tmp_path: Path, criu_bin: str
) -> None:
    steps = 200
    port = str(free_port())
    argv = [sys.executable, str(JOBS / "ddp_nccl.py"), str(steps), "0.05", port, "2", "--groups"]
    # world, tensor-parallel and data-parallel groups: three communicators a rank
    # (ddp_nccl.comms_per_rank), each with collectives at every step
    _pause_exit_restore(tmp_path, criu_bin, "groups", argv, steps, comms=3 * 2)
