"""``spotguard demo --container``: the demo's story with a podman container, on this machine.

Two "VMs" are two podman storages (``--root``/``--runroot``) under the work dir, each with its
own metadata emulator; the controller runs with the local provider; VM 1's real agent guards
``podman:counter`` (``spotguard agent --job podman:counter``). The container counts into its
bind mount; a spot notice goes to VM 1; the agent checkpoints the container into a file://
store (streamed, signed, manifest last) and removes it; the controller launches VM 2 (a local
"VM", another agent process), whose agent restores the container from its assignment — same
image, name and bind mount — and guards it. The demo then stops the counter and proves that
its output holds every number once, in order: what an uninterrupted run prints.

The job's image is built offline from this host's ``sh`` and ``sleep`` (no registry): imported
into VM 1, saved and loaded into VM 2, so both have the same image ID. Needs root, CRIU
(scripts/install-criu) and podman (scripts/install-podman). Every process and container it
started is stopped, and both storages reset, however it ends.

With a :class:`~spotguard.container.containerd.Containerd` backend (``--runtime containerd``)
the same story runs with ``containerd:demo/counter``: each VM is a containerd daemon of the
demo's own (:class:`~spotguard.container.containerd_vm.ContainerdVm`), the image an OCI layout
imported into both (scripts/install-containerd). With a
:class:`~spotguard.container.docker.Docker` backend (``--runtime docker``), ``docker:counter``
in two dockerds of the demo's own (:class:`~spotguard.container.docker_vm.DockerVm`;
scripts/install-docker).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from spotguard.container import dispatch
from spotguard.container.containerd import Containerd
from spotguard.container.containerd_vm import ContainerdVm, image_layout
from spotguard.container.dispatch import Backend
from spotguard.container.docker import Docker
from spotguard.container.docker_vm import DockerVm
from spotguard.container.podman import Podman
from spotguard.container.spec import ContainerRef
from spotguard.errors import DemoError, SpotguardError
from spotguard.image.settings import ImageSettings

IMAGE = "localhost/sg-demo-counter:1"
CONTAINER = "podman:counter"
#: the demo's container under containerd, under docker
CONTAINERD_CONTAINER = "containerd:demo/counter"
DOCKER_CONTAINER = "docker:counter"
TOKEN = "container-demo"
#: counts until told to stop (a file in its bind mount)
COUNTER = (
    "exec >>/data/out; i=0; while [ ! -e /data/stop ]; do echo $i; i=$((i+1)); sleep 0.05; done"
)


def rootfs_tar(dest: Path) -> Path:
    """A tarball rootfs with /bin/sh, /bin/sleep and the libraries they load (``ldd``)."""
    files = {"/bin/sh": "bin/sh", "/bin/sleep": "bin/sleep"}
    for binary in ("/bin/sh", "/bin/sleep"):
        out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            path = line.split("=>")[-1].split("(")[0].strip()
            if path.startswith("/"):
                files[path] = path.lstrip("/")
    tar = dest / "rootfs.tar"
    with tarfile.open(tar, "w") as t:
        for src, name in files.items():
            t.add(os.path.realpath(src), arcname=name)
        for d in ("data", "tmp"):
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d == "tmp" else 0o755
            t.addfile(info)
    return tar


def container_of(backend: Backend) -> str:
    """The demo's container under ``backend``'s runtime."""
    if isinstance(backend, Docker):
        return DOCKER_CONTAINER
    return CONTAINERD_CONTAINER if isinstance(backend, Containerd) else CONTAINER


async def same_image_on(vms: list[Backend], image: str, work: Path) -> None:
    """``image`` built from :func:`rootfs_tar` on the first podman, loaded into the others
    (``save``/``load``: the same image ID, as a registry pull would give); containerd: an OCI
    layout imported into each (the same manifest digest)."""
    tar = await asyncio.to_thread(rootfs_tar, work)
    if any(isinstance(v, Containerd) for v in vms):
        layout = await asyncio.to_thread(image_layout, tar, work / "image.tar", image)
        ns = ContainerRef.parse(CONTAINERD_CONTAINER).namespace
        for v in vms:
            if isinstance(v, Containerd):
                await v.run("images", "import", str(layout), namespace=ns, what="importing")
        return
    dockers = [v for v in vms if isinstance(v, Docker)]
    if dockers:
        first_d, *rest_d = dockers
        await first_d.run("import", "--change", 'CMD ["/bin/sh"]', str(tar), image, what="building")
        saved = work / "image.tar"
        await first_d.run("save", "-o", str(saved), image, what="saving the image")
        for d in rest_d:
            await d.run("load", "--quiet", "-i", str(saved), what="loading the image")
        return
    first, *rest = [v for v in vms if isinstance(v, Podman)]
    await first.run("import", "--change", 'CMD ["/bin/sh"]', str(tar), image, what="building")
    saved = work / "image.tar"
    await first.run("save", "--quiet", "-o", str(saved), image, what="saving the image")
    for p in rest:
        await p.run("load", "--quiet", "-i", str(saved), what="loading the image")


def vm_env(p: Backend) -> dict[str, str]:
    """What points a spotguard command at one VM's podman storage (or containerd) and CRIU."""
    if isinstance(p, Containerd):
        return {
            "SPOTGUARD_CONTAINER_CTR": p.ctr,
            "SPOTGUARD_CONTAINER_CONTAINERD_ADDRESS": str(p.address),
            "SPOTGUARD_CONTAINER_RUNC": p.runc,
            "SPOTGUARD_CRIU": p.criu,
        }
    if isinstance(p, Docker):
        return {
            "SPOTGUARD_CONTAINER_DOCKER": p.binary,
            "SPOTGUARD_CONTAINER_DOCKER_HOST": p.host,
            "SPOTGUARD_CONTAINER_RUNC": p.runc,
            "SPOTGUARD_CRIU": p.criu,
        }
    env = {"SPOTGUARD_CONTAINER_PODMAN": p.binary, "SPOTGUARD_CRIU": p.criu}
    if p.root is not None and p.runroot is not None:
        env.update(SPOTGUARD_CONTAINER_ROOT=str(p.root), SPOTGUARD_CONTAINER_RUNROOT=str(p.runroot))
    return env


@dataclass
class Result:
    """What the demo showed."""

    ok: bool
    numbers: int = 0
    image_url: str = ""
    history: list[str] = field(default_factory=list)
    seconds: float = 0.0
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class Stage:
    """What a caller of :func:`run_container_demo` may look at between its steps (a test
    checks the agent's status and ledger there): the controller, VM 1's metadata emulator,
    both podmans, the counter's bind mount, VM 1's state dir and its agent's API."""

    http: aiohttp.ClientSession
    controller: str
    sim1: Any  # MetadataSim
    vm1: Backend
    vm2: Backend
    data: Path
    state_dir: Path
    api: str
    container: str = CONTAINER

    async def job(self) -> dict[str, Any]:
        """The controller's view of the job."""
        return await _job(self.http, self.controller, self.container)


#: called at a step of the demo: once VM 1's agent protects the container, once VM 2's does
Hook = Callable[[Stage], Awaitable[None]]


async def _job(http: aiohttp.ClientSession, url: str, container: str) -> dict[str, Any]:
    job = ContainerRef.parse(container).job
    async with http.get(f"{url}/v1/jobs/{job}", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        out: dict[str, Any] = await r.json() if r.status == 200 else {}
        return out


async def _until(
    http: aiohttp.ClientSession,
    url: str,
    ok: Callable[[dict[str, Any]], bool],
    step: str,
    within: float,
    container: str = CONTAINER,
) -> dict[str, Any]:
    """The controller's view of the job once ``ok`` holds; DemoError ``step`` after ``within``."""
    end = time.monotonic() + within
    while True:
        v = await _job(http, url, container)
        if v and ok(v):
            return v
        if time.monotonic() > end:
            said = f"{v.get('state')}: {v.get('reason')}" if v else "unknown to the controller"
            raise DemoError(step, f"after {within:.0f} s the job is {said}")
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def _vms(backend: Backend) -> AsyncIterator[list[Backend]]:
    """Two VMs in a fresh short directory under /tmp: two containerd daemons of the demo's
    own, or two podman storages (podman refuses a run root longer than 50 characters);
    every container removed, daemons stopped, storages reset and the directory removed
    after."""
    base = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="sgdemo-", dir="/tmp"))
    if isinstance(backend, Docker):
        dockerds: list[DockerVm] = []
        try:
            for n in (1, 2):
                dvm = await asyncio.to_thread(DockerVm.start, base / f"vm{n}", backend.criu)
                dockerds.append(dvm)
            yield [d.docker for d in dockerds]
        finally:
            for dd in dockerds:
                await asyncio.to_thread(dd.stop)
            await asyncio.to_thread(shutil.rmtree, base, True)
        return
    if isinstance(backend, Containerd):
        daemons: list[ContainerdVm] = []
        try:
            for n in (1, 2):
                cvm = await asyncio.to_thread(ContainerdVm.start, base / f"vm{n}", backend.criu)
                daemons.append(cvm)
            yield [c.ctrd for c in daemons]
        finally:
            for c in daemons:
                await asyncio.to_thread(c.stop)
            await asyncio.to_thread(shutil.rmtree, base, True)
        return
    podman = backend
    vms = [
        Podman(podman.binary, podman.runc, podman.criu, base / f"vm{n}" / "storage",
               base / f"vm{n}" / "run", podman.runtime_dir, podman.timeout)
        for n in (1, 2)
    ]  # fmt: skip
    try:
        yield list[Backend](vms)
    finally:
        for p in vms:
            for args in (("rm", "--all", "--force", "--time", "0"), ("system", "reset", "--force")):
                with contextlib.suppress(SpotguardError):
                    await p.run(*args, what="cleaning up")
        await asyncio.to_thread(shutil.rmtree, base, True)


async def run_container_demo(
    podman: Backend,
    image: ImageSettings,
    work: Path,
    say: Callable[[str], None],
    *,
    timeout_s: float = 120,
    protected: Hook | None = None,
    relaunched: Hook | None = None,
) -> Result:
    """Run the demo (see the module's doc) in the directory ``work``; ``say`` is told each
    step; ``protected`` / ``relaunched`` are awaited once VM 1's / VM 2's agent protects the
    container. A link that does not hold is a :class:`DemoError` naming it. ``podman``: the
    runtime's backend (a :class:`Containerd` runs the containerd story; its ctr, runc and
    CRIU serve the demo's own daemons)."""
    from spotguard.controller.server import ControllerServer
    from spotguard.controller.settings import ControllerSettings
    from spotguard.providers.local import LocalProvider, LocalSettings
    from spotguard.simulator import MetadataSim, SimFacts

    data, store, t0 = work / "data", f"file://{work / 'store'}", time.monotonic()
    data.mkdir(parents=True, exist_ok=True)
    spotguard = str(Path(sys.executable).with_name("spotguard"))
    agent: asyncio.subprocess.Process | None = None
    container = container_of(podman)
    async with (
        _vms(podman) as (vm1, vm2),
        MetadataSim(facts=SimFacts(instance_id="i-0demovm1demovm1")) as sim1,
        MetadataSim(facts=SimFacts(instance_id="i-0demovm2demovm2")) as sim2,
    ):
        await same_image_on([vm1, vm2], IMAGE, work)
        say(f"image {IMAGE} built from this host's sh and sleep, on VM 1 and VM 2")
        base = {"SPOTGUARD_NOTICES_CLOUD": "aws", "SPOTGUARD_NOTICES_POLL_INTERVAL": "0.2",
                "SPOTGUARD_API_LISTEN": "127.0.0.1:0"}  # fmt: skip
        local = LocalProvider(
            LocalSettings.model_validate(
                {
                    "local_root": work / "local",
                    "local_agent_command": [spotguard, "agent", "--exit-when-done"],
                    "local_env": {**base, **sim2.env(), **vm_env(vm2), "SPOTGUARD_STORE": store},
                    "local_gpus": False,
                }
            )
        )
        settings = ControllerSettings.model_validate(
            {
                "listen": "127.0.0.1:0",
                "state": work / "controller.db",
                "controller_token": TOKEN,
                "tick_s": 0.1,
                "restore_timeout_s": timeout_s,
            }
        )
        try:
            async with (
                ControllerServer(settings, provider=local, image=image) as srv,
                aiohttp.ClientSession() as http,
            ):
                ref = ContainerRef.parse(container)
                await dispatch.start(
                    ref, IMAGE, ["/bin/sh", "-c", COUNTER], backend=vm1, volumes=[f"{data}:/data"]
                )
                env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
                env.update(base, **sim1.env(), **vm_env(vm1))
                port = _free_port()
                env.update(
                    SPOTGUARD_API_LISTEN=f"127.0.0.1:{port}",
                    SPOTGUARD_STATE_DIR=str(work / "vm1"),
                    SPOTGUARD_ASSIGNMENT=str(work / "vm1" / "no-assignment"),
                    SPOTGUARD_CONTROLLER_URL=srv.url,
                    SPOTGUARD_CONTROLLER_TOKEN=TOKEN,
                )
                with (work / "agent-vm1.log").open("ab") as log:
                    agent = await asyncio.create_subprocess_exec(
                        spotguard, "agent", "--job", container, "--store", store, env=env,
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    )  # fmt: skip
                await _until(
                    http, srv.url, lambda v: v.get("state") == "protected", "protect", 60, container
                )
                say(f"VM 1: {container} counts; its agent protects it ({ref.job})")
                stage = Stage(
                    http, srv.url, sim1, vm1, vm2, data, work / "vm1",
                    f"http://127.0.0.1:{port}", container,
                )  # fmt: skip
                if protected is not None:
                    await protected(stage)
                else:
                    await asyncio.sleep(1.0)  # let it count a little on VM 1
                sim1.state.send("aws", "preempt", in_seconds=120)
                say("VM 1: spot interruption notice sent (AWS, 2 minutes)")
                v = await _until(http, srv.url, _relaunched, "relaunch", timeout_s, container)
                say(f"checkpointed to {v['image_url']}; VM 2 restored it and its agent protects it")
                if relaunched is not None:
                    await relaunched(stage)
                await _counts_on(data / "out", 5, within=10.0)
                (data / "stop").touch()
                v = await _until(
                    http, srv.url, lambda v: v["state"] == "finished", "finish", 60, container
                )
        finally:
            if agent is not None and agent.returncode is None:
                os.killpg(agent.pid, signal.SIGTERM)
                await asyncio.wait_for(agent.wait(), 30)
            for vm in (work / "local" / "vms").glob("vm-*"):
                with contextlib.suppress(OSError, ValueError, KeyError, ProcessLookupError):
                    os.killpg(int(json.loads((vm / "vm.json").read_text())["pid"]), signal.SIGKILL)
    text = (data / "out").read_text()
    numbers = text.count("\n")
    history = [h["to"] for h in v["history"] if h["from"] != h["to"]]
    ok = text == "".join(f"{i}\n" for i in range(numbers))
    return Result(
        ok=ok, numbers=numbers, image_url=str(v.get("image_url")), history=history,
        seconds=round(time.monotonic() - t0, 1),
        reason="" if ok else f"the output in {data / 'out'} has a gap or a repeat",
    )  # fmt: skip


def _relaunched(v: dict[str, Any]) -> bool:
    return bool(v.get("restarts")) and v.get("state") == "protected"


async def _counts_on(out: Path, more: int, within: float) -> None:
    """The restored counter writes ``more`` lines within ``within`` seconds."""
    want, end = _count(out) + more, time.monotonic() + within
    while _count(out) < want:
        if time.monotonic() > end:
            raise DemoError("restore", f"the restored container does not count on ({out})")
        await asyncio.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _count(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0
