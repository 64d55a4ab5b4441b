"""The local provider: a "VM" is a sandbox on this machine — its own directory, state dir,
assignment file and agent process. The embedded default (``spotguard demo``) and the way to
run the whole relaunch path with no cloud account.

A VM launched for client token ``T`` lives in ``<root>/vms/vm-T/``::

    vm.json          what the controller needs: id, launch token, pid, process start time
    assignment.json  the Assignment (what user-data would write to /etc/spotguard/)
    user-data        the same, as the cloud-init script a cloud VM would receive
    state/           the agent's state dir (SPOTGUARD_STATE_DIR)
    run/jobs/        its agent's job locks (SPOTGUARD_JOB_LOCK_DIR: a VM's own /run)
    agent.log        the agent's stdout and stderr

The agent is started as ``local_agent_command`` (default ``spotguard agent``) in its own
process group with ``SPOTGUARD_ASSIGNMENT``, ``SPOTGUARD_STATE_DIR``,
``SPOTGUARD_CONTROLLER_URL``, ``SPOTGUARD_CONTROLLER_TOKEN``, ``SPOTGUARD_LOCAL_VM_ID``,
``SPOTGUARD_STORE`` (the assignment's store) and ``local_env``. ``terminate`` kills the process
group; ``describe`` checks the process is alive and, once it ended by itself, says why
(``state_reason``: its exit status and the last error line of its ``agent.log``).
The same client token always names the same VM, so a repeated launch starts nothing new.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import psutil
from pydantic import Field

from spotguard import safefs
from spotguard.config import Settings
from spotguard.contracts import ASSIGNMENT_ENV, Assignment
from spotguard.errors import PrecheckError, ProviderError, UnknownInstanceType
from spotguard.facts import GpuInventory
from spotguard.providers.base import (
    InstanceRef,
    InstanceState,
    InstanceTypeInfo,
    LaunchSpec,
    Market,
    Offer,
    offers_from_catalog,
    round_of,
)
from spotguard.providers.gpus import canonical_gpu

log = logging.getLogger(__name__)

REGION = "local"
ZONE = "local-1"
TYPE = "local"


def _default_command() -> list[str]:
    exe = Path(sys.executable).with_name("spotguard")
    return [str(exe) if exe.exists() else (shutil.which("spotguard") or "spotguard"), "agent"]


class LocalSettings(Settings):
    """Where local "VMs" live and what runs in them."""

    section: ClassVar[str] = "local"
    local_root: Path = Field(
        Path("/var/lib/spotguard/local"), description="Directory holding the local VMs"
    )
    local_agent_command: list[str] = Field(
        default_factory=_default_command, description="Command started in each local VM"
    )
    local_env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment for local VMs (e.g. metadata URL)"
    )
    local_gpus: bool = Field(True, description="Offer this host's GPUs (found through NVML)")


def _host_gpus() -> GpuInventory:
    """This host's GPUs via NVML; none when there is no driver."""
    from spotguard import nvml

    return nvml.inventory()


def _vm_id(client_token: str) -> str:
    return "vm-" + re.sub(r"[^a-zA-Z0-9_-]", "_", client_token)[:60]


#: The controller host's secrets, never passed on to a local VM (it gets its scoped token).
_CONTROLLER_SECRETS = frozenset(
    {
        "SPOTGUARD_CONTROLLER_TOKEN",
        "SPOTGUARD_CONTROLLER_TOKEN_FILE",
        "SPOTGUARD_VM_TOKEN_KEY_FILE",
    }
)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 (also when the file existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


#: how much of a VM's agent.log is read for the line that says why it ended
_LOG_TAIL_BYTES = 16 * 1024
_REASON_CHARS = 400


def ended_reason(code: int | None, log_path: Path) -> str:
    """Why a local VM's agent ended, in one line: its exit status (when this provider started
    it, so the status is known) and its last error line (``spotguard: error: ...``, else the
    log's last line), so the controller records the real reason for a failed relaunch."""
    if code is None:
        head = "the agent exited"
    elif code < 0:
        head = f"the agent was killed by signal {-code}"
    else:
        head = f"the agent exited with status {code}"
    try:
        with log_path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return head
    lines = [" ".join(ln.split()) for ln in tail.splitlines()]
    lines = [ln for ln in lines if ln]
    errors = [ln for ln in lines if ln.startswith("spotguard: error:")]
    last = (errors or lines or [""])[-1]
    if len(last) > _REASON_CHARS:
        last = last[: _REASON_CHARS - 1] + "…"
    return f"{head}: {last}" if last else head


class LocalProvider:
    """Sandboxes on this machine behind :class:`~spotguard.providers.base.CloudProvider`."""

    name = "local"

    def __init__(self, settings: LocalSettings) -> None:
        self.settings = settings
        self.root = self.settings.local_root / "vms"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._types: list[InstanceTypeInfo] | None = None

    def regions(self) -> list[str]:
        return [REGION]

    async def instance_types(self, region: str | None = None) -> list[InstanceTypeInfo]:
        if self._types is None:
            gpus = await asyncio.to_thread(_host_gpus) if self.settings.local_gpus else None
            gpus = gpus or GpuInventory()
            mem = gpus.devices[0].memory_total // (1024 * 1024) if gpus.devices else None
            self._types = [
                InstanceTypeInfo(
                    name=TYPE,
                    gpu_model=canonical_gpu(gpus.model, mem) if gpus.count else None,
                    gpu_count=gpus.count,
                    gpu_memory_mib=mem,
                    vcpus=os.cpu_count() or 1,
                    memory_mib=psutil.virtual_memory().total // (1024 * 1024),
                    spot=False,
                )
            ]
        return self._types

    async def instance_type(self, name: str) -> InstanceTypeInfo:
        for t in await self.instance_types():
            if t.name == name:
                return t
        raise UnknownInstanceType(
            f"unknown instance type {name!r}: the local provider has {TYPE!r}"
        )

    async def offers(self, spec: LaunchSpec) -> list[Offer]:
        if spec.target_region not in (None, REGION):
            return []
        if spec.gpu_count == 0:  # any sandbox here runs a CPU-only job
            spec = LaunchSpec(min_memory_mib=spec.min_memory_mib, target_type=spec.target_type)
        types = await self.instance_types()
        return offers_from_catalog(self.name, REGION, spec, types, {TYPE: [ZONE]})

    def _dir(self, vm_id: str) -> Path:
        return self.root / vm_id

    def _read(self, vm_id: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads((self._dir(vm_id) / "vm.json").read_text())
        except (OSError, ValueError):
            return None
        return data

    def _alive(self, vm: dict[str, Any]) -> bool:
        proc = self._procs.get(vm["id"])
        if proc is not None:
            return proc.poll() is None
        try:
            p = psutil.Process(int(vm["pid"]))
            return abs(p.create_time() - float(vm["started"])) < 1.0 and (
                p.status() != psutil.STATUS_ZOMBIE
            )
        except (psutil.Error, KeyError, ValueError):
            return False

    def _ref(self, vm: dict[str, Any]) -> InstanceRef:
        state = InstanceState.RUNNING if self._alive(vm) else InstanceState.TERMINATED
        why = None
        if vm.get("terminated"):
            state = InstanceState.TERMINATED
        elif state is InstanceState.TERMINATED:  # ended by itself: say why
            proc = self._procs.get(vm["id"])
            code = proc.returncode if proc is not None else None
            why = ended_reason(code, self._dir(vm["id"]) / "agent.log")
        return InstanceRef(
            provider=self.name,
            instance_id=vm["id"],
            region=REGION,
            zone=ZONE,
            instance_type=TYPE,
            market=Market.ON_DEMAND,
            launch_token=vm.get("launch_token"),
            state=state,
            extra={"dir": str(self._dir(vm["id"])), "pid": vm.get("pid")},
            state_reason=why,
        )

    async def launch(
        self, offer: Offer, assignment: Assignment, *, client_token: str
    ) -> InstanceRef:
        if offer.instance_type != TYPE:
            raise UnknownInstanceType(f"the local provider has no type {offer.instance_type!r}")
        vm_id = _vm_id(client_token)
        existing = self._read(vm_id)
        if existing is not None:  # same token: the same VM, never a second one
            return self._ref(existing)
        return await asyncio.to_thread(self._start, vm_id, client_token, assignment)

    def _start(self, vm_id: str, client_token: str, assignment: Assignment) -> InstanceRef:
        d = self._dir(vm_id)
        try:
            (d / "state").mkdir(parents=True, exist_ok=True)
            # The assignment holds the VM's scoped token: readable by its owner only.
            _write_private(d / "assignment.json", assignment.model_dump_json(indent=2))
            _write_private(d / "user-data", assignment.user_data())
            env = {
                **{k: v for k, v in os.environ.items() if k not in _CONTROLLER_SECRETS},
                ASSIGNMENT_ENV: str(d / "assignment.json"),
                "SPOTGUARD_STATE_DIR": str(d / "state"),
                "SPOTGUARD_LOCAL_VM_ID": vm_id,
                "SPOTGUARD_STORE": assignment.store,
                # this VM's own /run: its agent's job locks are not another VM's
                "SPOTGUARD_JOB_LOCK_DIR": str(d / "run" / "jobs"),
                **self.settings.local_env,
            }
            if assignment.controller_url:
                env["SPOTGUARD_CONTROLLER_URL"] = assignment.controller_url
            if assignment.controller_token:
                env["SPOTGUARD_CONTROLLER_TOKEN"] = assignment.controller_token
            with (d / "agent.log").open("ab") as logf:
                proc = subprocess.Popen(
                    self.settings.local_agent_command,
                    cwd=d,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except FileNotFoundError as exc:
            raise PrecheckError(
                f"local VM command {self.settings.local_agent_command[0]!r} not found"
            ) from exc
        except OSError as exc:
            raise ProviderError(f"cannot start local VM {vm_id} in {d}: {exc}") from exc
        self._procs[vm_id] = proc
        vm = {
            "id": vm_id,
            "launch_token": round_of(client_token),
            "client_token": client_token,
            "job": assignment.job,
            "pid": proc.pid,
            "started": psutil.Process(proc.pid).create_time(),
        }
        safefs.write_atomic(d / "vm.json", json.dumps(vm).encode())
        log.info("local VM started", extra={"vm": vm_id, "pid": proc.pid, "job": assignment.job})
        return self._ref(vm)

    async def wait_ready(self, ref: InstanceRef, timeout_s: float) -> InstanceRef:
        cur = await self.describe(ref)
        if cur.state is not InstanceState.RUNNING:
            why = f": {cur.state_reason}" if cur.state_reason else " (see its agent.log)"
            raise ProviderError(f"local VM {ref.instance_id} is not running{why}")
        return cur

    async def describe(self, ref: InstanceRef) -> InstanceRef:
        vm = self._read(ref.instance_id)
        if vm is None:
            return ref.with_state(InstanceState.TERMINATED)
        return self._ref(vm)

    async def terminate(self, ref: InstanceRef) -> None:
        vm = self._read(ref.instance_id)
        if vm is None:
            return
        await asyncio.to_thread(self._kill, vm)

    def _kill(self, vm: dict[str, Any]) -> None:
        if self._alive(vm):
            pid = int(vm["pid"])
            for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    break
                end = time.monotonic() + wait
                while time.monotonic() < end and self._alive(vm):
                    time.sleep(0.05)
                if not self._alive(vm):
                    break
        proc = self._procs.pop(vm["id"], None)
        if proc is not None:
            proc.wait(timeout=5)
        vm["terminated"] = True
        # replaced whole: the controller's describe (and any reader) never sees it torn
        safefs.write_atomic(self._dir(vm["id"]) / "vm.json", json.dumps(vm).encode())
        log.info("local VM terminated", extra={"vm": vm["id"]})

    async def find_by_token(self, token: str) -> InstanceRef | None:
        if not self.root.is_dir():
            return None
        for d in sorted(self.root.iterdir()):
            vm = self._read(d.name)
            if vm is not None and vm.get("launch_token") == token and not vm.get("terminated"):
                return self._ref(vm)
        return None

    async def aclose(self) -> None:
        """VMs outlive the controller (like cloud instances); only reap what has exited."""
        for vm_id, proc in list(self._procs.items()):
            if proc.poll() is not None:
                self._procs.pop(vm_id)
