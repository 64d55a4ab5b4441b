"""The parts of the embedded default, started for one demo run and always stopped again.

:class:`DemoStack` starts, in this order, each from spotguard's production code:

* a work dir (``vm1/`` = VM 1's state dir, ``local/`` = the local provider's VMs, ``store/``),
* the image store: ``file://{work}/store``, or a moto S3 server with ``--store s3``,
* one metadata emulator per VM (:class:`~spotguard.simulator.MetadataSim`; VM 2 must not see
  VM 1's notice),
* the controller (:class:`~spotguard.controller.server.ControllerServer`) with the local
  provider, whose "VMs" run ``spotguard agent --exit-when-done`` with an assignment,
* on request: the sample job (:func:`~spotguard.checkpoint.jobs.start_job`) and a real
  ``spotguard agent`` process protecting it on VM 1.

Leaving the context stops every process it started — agents (SIGTERM first, so a running
checkpoint ends and the job is never left frozen), local VMs, jobs, the reference run — then
the servers, and removes the work dir unless it is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from spotguard.checkpoint.criu import find_criu
from spotguard.checkpoint.jobs import JobInfo, list_jobs, start_job
from spotguard.controller.client import ControllerClient
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.demo.options import JOB_NAME, DemoOptions
from spotguard.errors import ConfigError, DemoError, SpotguardError
from spotguard.image.settings import ImageSettings
from spotguard.providers.local import LocalProvider, LocalSettings
from spotguard.simulator import MetadataSim, SimFacts

log = logging.getLogger(__name__)

JOB_MODULE = [sys.executable, "-m", "spotguard.demo.job"]
BUCKET = "spotguard-demo"

#: per cloud: (VM 1 facts, VM 2 facts) as the metadata services serve them
FACTS: dict[str, tuple[SimFacts, SimFacts]] = {
    "aws": (
        SimFacts(instance_id="i-0demo1vm1vm1vm1", zone="us-east-1a", name="vm-1"),
        SimFacts(instance_id="i-0demo2vm2vm2vm2", zone="us-east-1a", name="vm-2"),
    ),
    "gcp": (
        SimFacts(
            instance_id="4100000000000000001",
            instance_type="g2-standard-4",
            zone="us-central1-a",
            name="vm-1",
        ),
        SimFacts(
            instance_id="4100000000000000002",
            instance_type="g2-standard-4",
            zone="us-central1-a",
            name="vm-2",
        ),
    ),
    "azure": (
        SimFacts(
            instance_id="0f0e0d0c-0000-4000-8000-000000000001",
            instance_type="Standard_NC4as_T4_v3",
            region="eastus",
            zone="1",
            name="vm-1",
        ),
        SimFacts(
            instance_id="0f0e0d0c-0000-4000-8000-000000000002",
            instance_type="Standard_NC4as_T4_v3",
            region="eastus",
            zone="1",
            name="vm-2",
        ),
    ),
}


def spotguard_command() -> str:
    """The ``spotguard`` executable next to this Python (or on PATH)."""
    exe = Path(sys.executable).with_name("spotguard")
    if exe.exists():
        return str(exe)
    found = shutil.which("spotguard")
    if found is None:
        raise DemoError("setup", "the spotguard command is not installed (pip install -e .)")
    return found


def _short_listen(path: Path) -> str:
    """A unix socket address for ``path`` when it fits, else a free loopback port."""
    if len(str(path)) < 100:
        return f"unix:{path}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def _stop_group(pid: int, proc: asyncio.subprocess.Process | None, grace: float) -> None:
    """SIGTERM the process group ``pid`` leads, SIGKILL it after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if proc is not None and proc.returncode is not None:
                return
            if proc is None and not _alive(pid):
                return
            await asyncio.sleep(0.05)
    if proc is not None and proc.returncode is None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 5.0)


def _alive(pid: int, since: float | None = None) -> bool:
    try:
        p = psutil.Process(pid)
        if since is not None and p.create_time() < since - 1.0:
            return False  # a pid reused by an older process: not ours
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class DemoStack:
    """The demo's processes and servers (see the module docstring)."""

    def __init__(self, opts: DemoOptions, image: ImageSettings) -> None:
        self.opts = opts
        self.started = time.time()
        self.token = secrets.token_urlsafe(16)
        self.api_token = secrets.token_urlsafe(16)
        if opts.workdir is not None:
            self.root = opts.workdir.resolve()
            self._made_root = not self.root.exists()
            if not self._made_root and any(self.root.iterdir()):
                raise ConfigError(f"--workdir {self.root} is not empty")
        else:
            self.root = Path(tempfile.mkdtemp(prefix="spotguard-demo-"))
            self._made_root = True
        self.shm = Path("/dev/shm") / f"spotguard-demo-{secrets.token_hex(4)}"
        self.vm1 = self.root / "vm1"
        self.local_root = self.root / "local"
        self.store_url = f"file://{self.root / 'store'}"
        #: the ``[image]`` settings loaded by ``spotguard demo`` (the controller and the
        #: demo's own checks read the images with them, as the agents do)
        self.image = image
        self.spotguard = ""
        self.criu = ""
        self.controller_url = ""
        self.agent1_listen = _short_listen(self.vm1 / "agent.sock")
        self.sims: tuple[MetadataSim, MetadataSim] | None = None
        self.job: JobInfo | None = None
        self.agent1: asyncio.subprocess.Process | None = None
        self.reference_proc: asyncio.subprocess.Process | None = None
        self.server: ControllerServer | None = None
        self.client: ControllerClient | None = None
        self.keep = opts.keep
        self._stack = AsyncExitStack()
        self._env_saved: dict[str, str | None] = {}

    # --- start --------------------------------------------------------------------------

    async def __aenter__(self) -> DemoStack:
        try:
            await self._start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _start(self) -> None:
        if os.geteuid() != 0:
            raise DemoError("setup", "CRIU needs root: run the demo as root (sudo make demo)")
        try:
            self.criu = find_criu(os.environ.get("SPOTGUARD_CRIU") or None)
        except SpotguardError as exc:
            raise DemoError("setup", str(exc)) from exc
        self.spotguard = spotguard_command()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.vm1 / "state").mkdir(parents=True, exist_ok=True)
        self.shm.mkdir(parents=True, exist_ok=True)
        await self._start_store()
        facts1, facts2 = FACTS[self.opts.cloud]
        sim1 = await self._stack.enter_async_context(MetadataSim(facts=facts1))
        sim2 = await self._stack.enter_async_context(MetadataSim(facts=facts2))
        self.sims = (sim1, sim2)
        await self._start_controller(sim2)

    async def _start_store(self) -> None:
        if self.opts.fault == "store":
            # A regular file where the store's directory must be: every write fails.
            blocker = self.root / "store-is-a-file"
            blocker.write_text("the demo's --fault store puts this file in the store's way\n")
            self.store_url = f"file://{blocker}/images"
            return
        if self.opts.store == "file":
            (self.root / "store").mkdir(exist_ok=True)
            return
        try:
            from moto.server import ThreadedMotoServer
        except ImportError as exc:
            raise DemoError(
                "setup", f"--store s3 needs moto[server] (pip install -e '.[dev]'): {exc}"
            ) from exc
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        with contextlib.redirect_stdout(io.StringIO()):  # it announces itself on stdout
            server.start()
        self._stack.callback(server.stop)
        host, port = server.get_host_and_port()
        self._setenv(
            AWS_ENDPOINT_URL=f"http://{host}:{port}",
            AWS_ACCESS_KEY_ID="demo",
            AWS_SECRET_ACCESS_KEY="demo",
            AWS_DEFAULT_REGION="us-east-1",
        )
        import boto3

        await asyncio.to_thread(
            lambda: boto3.client("s3", endpoint_url=f"http://{host}:{port}").create_bucket(
                Bucket=BUCKET
            )
        )
        self.store_url = f"s3://{BUCKET}/images"

    def _setenv(self, **values: str) -> None:
        for k, v in values.items():
            self._env_saved.setdefault(k, os.environ.get(k))
            os.environ[k] = v

    def agent_env(self, sim: MetadataSim, shm: Path, **extra: str) -> dict[str, str]:
        """Environment of an agent on a VM whose metadata service is ``sim``."""
        return {
            **sim.env(),
            "SPOTGUARD_CRIU": self.criu,
            "SPOTGUARD_SHM_DIR": str(shm),
            "SPOTGUARD_NOTICES_CLOUD": self.opts.cloud,
            "SPOTGUARD_NOTICES_POLL_INTERVAL": "0.2",
            "SPOTGUARD_LOG_FORMAT": "json",
            **extra,
        }

    async def _start_controller(self, sim2: MetadataSim) -> None:
        vm_env = self.agent_env(
            sim2,
            self.shm / "vm2",
            SPOTGUARD_API_LISTEN="127.0.0.1:0",
            SPOTGUARD_STORE=self.store_url,
        )
        command = [self.spotguard, "agent", "--exit-when-done"]
        if self.opts.fault == "launch":
            command = [str(self.root / "no-such-agent"), "agent"]
        if self.opts.fault == "restore":
            vm_env["SPOTGUARD_CRIU"] = str(self.root / "no-criu-on-vm2")
        provider = LocalProvider(
            LocalSettings(
                local_root=self.local_root,
                local_agent_command=command,
                local_env=vm_env,
                local_gpus=self.opts.gpu != "no",
            )
        )
        settings = ControllerSettings.model_validate(
            {
                "listen": "127.0.0.1:0",
                "state": self.root / "controller.db",
                "controller_token": self.token,
                "default_store": self.store_url,
                "tick_s": 0.1,
                "max_restarts": 2,
                "ready_timeout_s": self.opts.stage_timeout,
                "restore_timeout_s": self.opts.stage_timeout,
                "capacity_retry_s": 1.0,
                "capacity_rounds": 1,
            }
        )
        self.server = await self._stack.enter_async_context(
            ControllerServer(settings, provider=provider, image=self.image)
        )
        self.controller_url = self.server.url
        self.client = ControllerClient(self.controller_url, self.token, timeout_s=10.0)

    # --- the job and its agent ------------------------------------------------------------

    async def start_reference(self) -> str:
        """The job's output when nothing interrupts it (same arguments, no sleeping)."""
        proc = await asyncio.create_subprocess_exec(
            *JOB_MODULE,
            *self.opts.job_args(step_seconds=0),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self.reference_proc = proc
        out, err = await proc.communicate()
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise DemoError(
                "reference", f"the uninterrupted run exited with {proc.returncode}: {tail[0]}"
            )
        return out.decode()

    async def start_job(self) -> JobInfo:
        """Start the sample job on VM 1 as a checkpointable job (``spotguard run``'s code)."""
        try:
            self.job = await start_job(
                [*JOB_MODULE, *self.opts.job_args()],
                JOB_NAME,
                state_dir=self.vm1 / "state",
                cwd=self.root,
            )
        except SpotguardError as exc:
            raise DemoError("job", f"cannot start the sample job: {exc}") from exc
        return self.job

    async def start_agent1(self) -> None:
        """``spotguard agent --job train`` on VM 1, reporting to the controller."""
        assert self.sims is not None
        env = {
            **os.environ,
            **self.agent_env(
                self.sims[0],
                self.shm / "vm1",
                SPOTGUARD_STATE_DIR=str(self.vm1 / "state"),
                SPOTGUARD_ASSIGNMENT=str(self.vm1 / "no-assignment.json"),
                SPOTGUARD_CONTROLLER_URL=self.controller_url,
                SPOTGUARD_CONTROLLER_TOKEN=self.token,
                SPOTGUARD_API_LISTEN=self.agent1_listen,
                SPOTGUARD_API_TOKEN=self.api_token,
            ),
        }
        argv = [self.spotguard, "agent", "--job", JOB_NAME, "--store", self.store_url]
        with (self.vm1 / "agent.log").open("ab") as logf:
            self.agent1 = await asyncio.create_subprocess_exec(
                *argv,
                "--exit-when-done",
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logf,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )

    def vm_dirs(self) -> list[Path]:
        """The local provider's VM directories, oldest first."""
        root = self.local_root / "vms"
        if not root.is_dir():
            return []
        return sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)

    def root_exists(self) -> bool:
        return self.root.is_dir()

    def job_dirs(self) -> list[Path]:
        """State dirs of VM 1 and of every local VM."""
        return [self.vm1 / "state", *(d / "state" for d in self.vm_dirs())]

    # --- stop -----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop everything this run started (each step on its own: one failing step must not
        leave the rest running)."""
        steps: list[tuple[str, Any]] = [
            ("agent on VM 1", self._stop_agent1),
            ("local VMs", self._stop_vms),
            ("jobs", self._kill_jobs),
            ("reference run", self._stop_reference),
            ("servers", self._stack.aclose),
        ]
        for what, fn in steps:
            try:
                await fn()
            except Exception as exc:  # noqa: BLE001 - keep cleaning up whatever failed
                log.warning("demo cleanup step failed", extra={"what": what, "error": str(exc)})
        for k, v in self._env_saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(self.shm, ignore_errors=True)
        if not self.keep and self._made_root:
            for _ in range(20):  # a process being reaped may still write a last line into it
                shutil.rmtree(self.root, ignore_errors=True)
                if not self.root.exists():
                    break
                await asyncio.sleep(0.1)

    async def _stop_agent1(self) -> None:
        if self.agent1 is not None and self.agent1.returncode is None:
            await _stop_group(self.agent1.pid, self.agent1, grace=30.0)

    async def _stop_vms(self) -> None:
        import json

        for d in self.vm_dirs():
            try:
                vm = json.loads((d / "vm.json").read_text())
                pid = int(vm["pid"])
            except (OSError, ValueError, KeyError):
                continue
            if _alive(pid, self.started):
                await _stop_group(pid, None, grace=30.0)

    async def _kill_jobs(self) -> None:
        for state in self.job_dirs():
            for job in list_jobs(state):
                if _alive(job.pid, self.started):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(job.pid, signal.SIGKILL)

    async def _stop_reference(self) -> None:
        proc = self.reference_proc
        if proc is not None and proc.returncode is None:
            await _stop_group(proc.pid, proc, grace=1.0)
