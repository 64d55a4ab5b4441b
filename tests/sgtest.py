"""Helpers shared by the whole suite (``tests/`` is on ``sys.path`` through the root
``conftest.py``): a free local port, polling until a condition holds (blocking and async), a
job's output growing, the store-server fixtures, a store that holds chunks back
(``GatedStore``), the CRIU-backed checkpoint settings of one test (the ``settings``
fixture), and ``spotguard`` run as a console script with none of the caller's
``SPOTGUARD_*`` settings (:func:`sg`: a config file, an environment added, a working
directory; :func:`sg_json` its JSON answer). Helpers of one area stay in that area's
``*_helpers.py``; the ones several areas copied live here, once.

What stays apart, and why: ``tests/ops``' ``sg`` can hide top-level modules (an install
without an extra) and ``_run`` in its config-once test runs a counting wrapper, not the
command; ``sg_env`` hands a job's exact environment through (``SPOTGUARD_*`` included);
``tests/container`` points the CLI at a podman VM through its own environment (its area's
helper). The rest — the UI's, the controller CLI's, the notices CLI's, the URL and fleet
tests' runners — were this one with other defaults, and call it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest

from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.testing import RecordingGpu
from spotguard.errors import GpuError, StoreUnavailable
from spotguard.store.base import ImageStore, ObjectInfo


def installed(binary: Path, script: str) -> None:
    """Run ``scripts/SCRIPT`` where ``binary`` is not there yet; skip the test where it still
    is not (fail it in CI, where ``SPOTGUARD_REQUIRE_CRIU=1`` says the installers must work)."""
    if not os.access(binary, os.X_OK):
        repo = Path(__file__).resolve().parents[1]
        subprocess.run([str(repo / "scripts" / script)], check=False)
    if not os.access(binary, os.X_OK):
        if os.environ.get("SPOTGUARD_REQUIRE_CRIU") == "1":
            pytest.fail(f"{binary} could not be installed (scripts/{script})")
        pytest.skip(f"{binary} is not installed (scripts/{script})")


def _in_pid_namespace(code: str, *args: str, own_proc: bool = True) -> subprocess.Popen[str]:
    """``python -c code args`` as PID 1 of a new PID namespace with its own /proc (what an
    agent in a container sees; ``own_proc=False``: the host's /proc kept, whose pids are not
    its own), its stdout a pipe; killing the returned process ends it."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a PID namespace)")
    ns = ["unshare", "-m", "-p", "-f", "--kill-child", "--propagation", "private"]
    ns += ["--mount-proc"] if own_proc else []
    return subprocess.Popen([*ns, sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip


def run_in_pid_namespace(code: str, *args: str, own_proc: bool = True) -> str:
    """Run ``python -c code args`` in a PID namespace of its own (:func:`_in_pid_namespace`)
    to its end; its output, stripped (it must exit 0)."""
    proc = _in_pid_namespace(code, *args, own_proc=own_proc)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out.strip()


@contextlib.contextmanager
def held_in_pid_namespace(code: str, *args: str) -> Iterator[str]:
    """Start ``python -c code args`` in a PID namespace of its own, yield the first line it
    prints (it then waits, holding what it made) and end it on exit."""
    proc = _in_pid_namespace(code, *args)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    cond: Callable[[], object], what: str, limit: float = 60.0, every: float = 0.05
) -> None:
    """Poll ``cond`` every ``every`` seconds until it is true; fail the test, naming ``what``,
    after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(every)


async def until(
    cond: Callable[[], object], what: str, limit: float = 30.0, every: float = 0.05
) -> None:
    """:func:`wait_for` on the event loop: poll ``cond`` every ``every`` seconds without
    blocking the loop; fail the test, naming ``what``, after ``limit`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not cond():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(every)


def line_count(path: Path) -> int:
    """How many complete lines ``path`` holds (0 while it does not exist)."""
    return path.read_text().count("\n") if path.exists() else 0


def wait_lines(path: Path, n: int, timeout: float = 30.0) -> None:
    """Wait until ``path`` holds at least ``n`` lines (a job's output grew)."""
    end = time.monotonic() + timeout
    while line_count(path) < n:
        assert time.monotonic() < end, f"{path} did not reach {n} lines"
        time.sleep(0.05)


async def grows(path: Path, more: int, limit: float = 30.0) -> None:
    """Wait (on the event loop) until ``path`` holds ``more`` lines more than now: a job's
    output shows that it runs."""
    start = line_count(path)
    await until(lambda: line_count(path) >= start + more, f"{path} to grow", limit)


@pytest.fixture(name="settings")
def criu_settings(tmp_path: Path, criu_bin: str) -> CheckpointSettings:
    """Checkpoint settings of one test: state and shm under ``tmp_path``, the suite's CRIU,
    a 60 s CRIU limit. A test module takes it as ``settings`` by importing it
    (``from sgtest import criu_settings``)."""
    return CheckpointSettings(
        state_dir=tmp_path / "state", shm_dir=tmp_path / "shm", criu=criu_bin, criu_timeout=60
    )


def without_spotguard_settings(**extra: str) -> dict[str, str]:
    """This process's environment without any ``SPOTGUARD_*`` variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    env.update(extra)
    return env


def sg(
    *args: str,
    env: dict[str, str] | None = None,
    config: Path | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """``spotguard ARGS`` as a user runs it (this interpreter's console script), without the
    caller's ``SPOTGUARD_*`` settings; ``env`` adds to that environment, ``config`` is given
    as ``--config`` before ``ARGS``, ``cwd`` is where it runs."""
    head = ["--config", str(config)] if config is not None else []
    return subprocess.run(
        [str(Path(sys.executable).parent / "spotguard"), *head, *args],
        capture_output=True,
        text=True,
        env=without_spotguard_settings(**(env or {})),
        cwd=cwd,
        timeout=timeout,
    )


def sg_json(
    *args: str,
    env: dict[str, str] | None = None,
    config: Path | None = None,
    cwd: Path | None = None,
    timeout: float | None = 120.0,
) -> dict[str, Any]:
    """:func:`sg` that must succeed (exit 0, no traceback) with a JSON object: its whole
    output, or its last line (log lines may come before it)."""
    res = sg(*args, env=env, config=config, cwd=cwd, timeout=timeout)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    text = res.stdout.strip()
    try:
        out = json.loads(text)
    except ValueError:
        out = json.loads(text.splitlines()[-1])
    assert isinstance(out, dict), text[-3000:]
    return out


def sg_env(
    *args: str, env: dict[str, str], timeout: float | None = 300.0
) -> subprocess.CompletedProcess[str]:
    """``spotguard ARGS`` — this interpreter's console script — with exactly ``env`` (the
    tests that hand a job's environment through, ``SPOTGUARD_*`` settings included)."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "spotguard"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def store_servers() -> ModuleType:
    """``tests/store/store_servers.py`` (the real moto, fake-gcs and fault-proxy fixtures), loaded
    once under one module name whichever test directory asks first: the conftests of
    tests/store, tests/image and tests/faults re-export its fixtures, and a session-scoped
    server must be one object for all of them (``tests/store`` is on ``sys.path`` only when a
    test there is collected, so a plain import would not do)."""
    name = "spotguard_test_store_servers"
    if name not in sys.modules:
        path = Path(__file__).parent / "store" / "store_servers.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


class StagingGpu(RecordingGpu):
    """The driver's stand-in for a job that stages memory as ``cuCheckpointProcessCheckpoint``
    does: the GPU process is the one running ``script``; its checkpoint sends it SIGUSR1 and
    waits for ``here/staged``; with ``checks``, its restore sends SIGUSR2 and waits for one
    more line in ``here/checked`` (the job read back every byte, as the driver's restore
    does)."""

    def __init__(self, here: Path, script: str, *, checks: bool = True, memory: int = 0) -> None:
        super().__init__(
            select=lambda pids: [p for p in pids if _runs(p, script)][:1], memory=memory
        )
        self.here = here
        self.with_checks = checks

    async def checkpoint(self, pids: Sequence[int]) -> None:
        await super().checkpoint(pids)
        for p in pids:
            os.kill(p, signal.SIGUSR1)
        await until(lambda: (self.here / "staged").exists(), "the job staging its range")

    async def restore(self, pids: Sequence[int], remap: object = None) -> None:
        await super().restore(pids)
        if not self.with_checks:
            return
        had = self.checks()
        for p in pids:
            os.kill(p, signal.SIGUSR2)
        # as the driver's restore: it returns when its process dies (a failed write-back kills
        # it), not only once the process read its memory back
        await until(
            lambda: len(self.checks()) > len(had) or not all(_living(p) for p in pids),
            "the job checking its range",
        )
        if len(self.checks()) <= len(had):
            raise GpuError(f"GPU process {list(pids)} ended during its restore")

    def checks(self) -> list[str]:
        path = self.here / "checked"
        return path.read_text().split() if path.exists() else []


def _living(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


def _runs(pid: int, script: str) -> bool:
    """``pid`` is the Python process running ``script`` (a tree's root is spotguard's init)."""
    with contextlib.suppress(psutil.Error):
        argv = psutil.Process(pid).cmdline()
        return len(argv) > 1 and argv[1].endswith(script)
    return False


def flip_a_byte(path: Path) -> int:
    """Flip one bit of the stored chunk at ``path`` so that what it decodes to changes (or it
    no longer decodes), and return the offset flipped.

    A zstd frame has bits its decoder never reads: about one single-bit flip in 400 of a
    compressed chunk decodes to the very same plaintext, whose BLAKE3 address then still
    matches (the restore verifies what it restores, which is unchanged; docs/image-format.md,
    "What is verified"). A test of tamper detection must change the image, so for a zstd frame
    this walks from the middle to the first flip that changes the decoded bytes; any other
    object (an encrypted chunk: AES-GCM authenticates every stored byte) is flipped mid-way.
    """
    import zstandard

    data = bytearray(path.read_bytes())
    start = len(data) // 2
    if bytes(data[:4]) != b"\x28\xb5\x2f\xfd":
        data[start] ^= 0x01
        path.write_bytes(bytes(data))
        return start
    dz = zstandard.ZstdDecompressor()
    plain = dz.decompress(bytes(data), max_output_size=1 << 30)
    for at in [*range(start, len(data)), *range(4, start)]:
        data[at] ^= 0x01
        try:
            changed = dz.decompress(bytes(data), max_output_size=1 << 30) != plain
        except zstandard.ZstdError:
            changed = True
        if changed:
            path.write_bytes(bytes(data))
            return at
        data[at] ^= 0x01
    raise AssertionError(f"no single-bit flip changes what {path} decodes to")


class GatedStore:
    """A file store whose chunk uploads stop after ``allow`` until ``gate`` opens: a slow
    store, so CRIU is provably mid-dump (blocked on a full pipe) when the test strikes."""

    def __init__(self, inner: ImageStore, allow: int = 2) -> None:
        self.inner = inner
        self.url = inner.url
        self.allow = allow
        self.gate = asyncio.Event()
        self.blocked = asyncio.Event()

    async def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        if "/chunks/" in key:
            if self.allow <= 0:
                self.blocked.set()
                await self.gate.wait()
            self.allow -= 1
        await self.inner.put(key, data, if_absent=if_absent)

    async def sync(self, keys: Sequence[str]) -> None:
        await self.inner.sync(keys)  # the writer's durability batch must reach the file store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        return await self.inner.list(prefix)


class FailingStore(GatedStore):
    """A file store that refuses every chunk upload after ``allow`` (the store goes away
    mid-stream)."""

    async def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        if "/chunks/" in key:
            if self.allow <= 0:
                raise StoreUnavailable(f"{key}: the store went away")
            self.allow -= 1
        await self.inner.put(key, data, if_absent=if_absent)


def json_error_problem(status: int, body: bytes) -> str | None:
    """What is wrong with a refusal's body (``status`` >= 400) as spotguard's HTTP servers
    promise it — one JSON object whose ``error`` is one non-empty line — or None."""
    try:
        doc = json.loads(body)
    except ValueError:
        return f"{status}, a body that is not JSON: {body[:200]!r}"
    if not isinstance(doc, dict) or not isinstance(doc.get("error"), str) or not doc["error"]:
        return f"{status} without an error message: {body[:200]!r}"
    if "\n" in doc["error"]:
        return f"{status}: an error of more than one line: {doc['error'][:200]!r}"
    return None
