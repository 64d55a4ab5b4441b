"""``spotguard run``, ``spotguard checkpoint`` and ``spotguard restore`` (local directories, or
store URLs through :mod:`spotguard.operations`)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import click

from spotguard import operations
from spotguard.agent import discovery
from spotguard.checkpoint.cuda import NVIDIA_CTL
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import resolve_job, start_job
from spotguard.checkpoint.scan import job_environment
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.cli import config
from spotguard.commands.common import ADVANCED, checkpoint_options
from spotguard.config import load, options
from spotguard.container import cli as container_cli
from spotguard.container.spec import is_container_job
from spotguard.errors import ConfigError, SpotguardError
from spotguard.groupwire import GROUP_ENV, check_group_name
from spotguard.image.settings import ImageSettings
from spotguard.planner import PlannerSettings

_RUN_ONLY = ("state_dir", "nccl", "nccl_shim")
_ENGINE_EXCLUDE: tuple[str, ...] = ()


def _settings(ctx: click.Context, flags: dict[str, Any]) -> CheckpointSettings:
    return load(CheckpointSettings, flags, config_file=config(ctx))


def _engine(s: CheckpointSettings) -> Engine:
    from spotguard.operations.checkpoint import engine_for

    return engine_for(s)


def _steps(timeline: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"{t['name']} {t['seconds']:.3f}s" for t in timeline if t.get("seconds") is not None
    )


@click.command("run", context_settings={"ignore_unknown_options": True})
@click.option("--name", help="Job name (default: from the command, plus a random suffix).")
@click.option("--json", "as_json", is_flag=True, help='Print {"job": ..., "pid": ...}.')
@click.option(
    "--pid-namespace/--no-pid-namespace",
    default=True,
    help=(
        "Own PID and mount namespaces (default; GPU jobs too). --no-pid-namespace runs it in "
        "the host's: restore then needs its exact PIDs free (docs/limits.md)."
    ),
)
@click.option(
    "--no-protect",
    "no_protect",
    is_flag=True,
    help="Do not let the running agent protect this job (it protects every other job "
    "'spotguard run' starts).",
)
@click.option(
    "--priority",
    type=int,
    default=None,
    help="Priority on this node: lower-priority jobs are parked to give this one the GPU.",
)
@click.option(
    "--gpu-memory",
    default=None,
    help="GPU memory this job needs (e.g. 40G, 512M): with --priority, room is made for it.",
)
@click.option(
    "--nccl-group",
    "nccl_group",
    default=None,
    help="The run this job is one VM's part of: its NCCL communicators span the jobs started "
    "with the same group on other VMs; their agents release and rebuild them together "
    "through the controller (docs/limits.md, NCCL).",
)
@options(
    CheckpointSettings,
    exclude=tuple(n for n in CheckpointSettings.model_fields if n not in _RUN_ONLY),
)
@container_cli.run_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def run(
    ctx: click.Context,
    /,
    name: str | None,
    as_json: bool,
    pid_namespace: bool,
    no_protect: bool,
    priority: int | None,
    gpu_memory: str | None,
    nccl_group: str | None,
    command: tuple[str, ...],
    **flags: Any,
) -> None:
    """Start COMMAND as a job that can be checkpointed and restored elsewhere.

    The job gets its own session, PID and mount namespaces, stdin from /dev/null, NCCL
    made checkpointable — --nccl release (default): spotguard's NCCL shim preloaded, NCCL
    keeps its fast transports and its communicators are released before each freeze and
    rebuilt after (needs scripts/install-nccl-shim; without it, restrict); --nccl restrict:
    NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1, NCCL_NVLS_ENABLE=0, ... where not set —,
    USE_LIBUV=0 unless set (PyTorch's TCPStore then holds no io_uring, which CRIU cannot
    dump), and its output in <state_dir>/jobs/<name>/stdout and stderr.
    Example: spotguard run --name t -- python t.py

    With --container podman:NAME, COMMAND is IMAGE [ARGS...]: a podman container that
    `spotguard checkpoint podman:NAME` can checkpoint (docs/containers.md).
    """
    mine = container_cli.split_run_flags(flags)
    if mine["container"] is not None:
        container_cli.run(ctx, mine, command, _settings(ctx, flags).criu, as_json)
        return
    if os.geteuid() != 0:  # usage, as for `install` (exit 2: docs/operations.md)
        raise ConfigError(
            "spotguard run needs root (the job's PID namespace and CRIU require it): "
            "run it with sudo"
        )
    s = _settings(ctx, flags)
    claim = None
    parked: list[str] = []
    if priority is not None or gpu_memory is not None:
        from spotguard.commands.park import make_room

        claim, parked = make_room(ctx, s, priority or 0, gpu_memory, name or command[0])
    env = job_environment(os.environ)
    if nccl_group is not None:
        env[GROUP_ENV] = check_group_name(nccl_group)
    shim = s.nccl_shim if s.nccl == "release" and s.nccl_shim.is_file() else None
    files: dict[str, bytes] = {}
    if claim is not None:  # in the job's directory before anything can see the job
        from spotguard.park.priority import CLAIM_FILE, claim_bytes

        files[CLAIM_FILE] = claim_bytes(claim)
    job = asyncio.run(
        start_job(
            list(command),
            name,
            state_dir=s.state_dir,
            env=env,
            pid_namespace=pid_namespace,
            nccl_shim=shim,
            protect=not no_protect,
            files=files,
        )
    )
    asked = flags.get("nccl") is not None or flags.get("nccl_shim") is not None
    # said once the job runs (not for bad input), and only where NCCL can matter: on a host
    # with an NVIDIA GPU, or when the command line asked for the shim
    if s.nccl == "release" and shim is None and (asked or Path(NVIDIA_CTL).exists()):
        click.echo(
            f"spotguard run: no NCCL shim at {s.nccl_shim} (scripts/install-nccl-shim): NCCL's "
            "fast transports are turned off for this job (--nccl restrict)",
            err=True,
        )
    agent = _local_agent(ctx, s.state_dir)
    protection = discovery.protector(agent, opted=no_protect)
    if as_json:
        out: dict[str, Any] = {"job": job.name, "pid": job.pid, "dir": str(job.dir)}
        out["protected_by"] = (
            agent["agent"]["pid"]
            if agent is not None and agent["agent"].get("discover") and not no_protect
            else None
        )
        click.echo(json.dumps({**out, "parked": parked} if claim is not None else out))
    else:
        made = f" (parked for room: {', '.join(parked)})" if parked else ""
        click.echo(f"job {job.name} started: pid {job.pid}, output in {job.dir}{made}")
        click.echo(f"job {job.name} is {protection}")


def _local_agent(ctx: click.Context, state_dir: Path) -> dict[str, Any] | None:
    """The local agent's status answer, or None when no agent answers (as root, the API
    token is read from the state dir, as ``spotguard status`` does)."""
    from spotguard.agent.client import call
    from spotguard.commands.agent import _api

    try:
        listen, token = _api(ctx, {"state_dir": state_dir})
        return asyncio.run(call(listen, token, "GET", "/status", timeout_s=5.0))
    except SpotguardError:
        return None


@click.command("checkpoint", epilog=ADVANCED)
@click.argument("job")
@click.option(
    "--to",
    "to",
    required=True,
    help=(
        "Directory to write the image to (created; must not hold an image), or a store URL "
        "(s3://, gs://, file://) to stream (or stage and push, see --stream) it to."
    ),
)
@click.option("--leave-running", is_flag=True, help="Keep the job running after the dump.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@checkpoint_options()
@click.pass_context
def checkpoint(
    ctx: click.Context, /, job: str, to: str, leave_running: bool, as_json: bool, **flags: Any
) -> None:
    """Freeze JOB (a pid, a job name, or a container: podman:NAME) — CPU and GPU — into the
    directory or store URL --to."""
    s = _settings(ctx, flags)
    if is_container_job(job):
        container_cli.checkpoint(
            ctx,
            job,
            to,
            leave_running=leave_running,
            as_json=as_json,
            state_dir=s.state_dir,
            criu=s.criu,
            tcp_established=s.tcp_established,
        )
        return
    info = resolve_job(job, state_dir=s.state_dir)
    mode = Mode.RESUME if leave_running else Mode.EXIT
    if operations.is_url(to):
        image = load(ImageSettings, {}, config_file=config(ctx))
        planner = load(PlannerSettings, {}, config_file=config(ctx))
        pushed = asyncio.run(
            operations.checkpoint(
                info, to, mode=mode, settings=s, image_settings=image, planner_settings=planner
            )
        )
        if as_json:
            click.echo(json.dumps(pushed.to_json()))
        else:
            click.echo(
                f"job {info.name} checkpointed to {pushed.image_url} ({mode}); "
                f"{pushed.bytes} bytes, {pushed.skipped_bytes} already stored: "
                f"{_steps(pushed.timeline.to_list())}"
            )
        return
    result = asyncio.run(_engine(s).freeze(info, DirectoryTarget(Path(to).absolute()), mode))
    if as_json:
        click.echo(json.dumps(result.to_json()))
    else:
        click.echo(
            f"job {info.name} checkpointed to {result.images_dir} ({mode}); "
            f"paused {result.pause_seconds:.3f}s: {_steps(result.timeline.to_list())}"
        )


@click.command("restore", epilog=ADVANCED)
@click.argument("image")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option(
    "--name", default=None, help="A container image: the new container's name (default: its own)."
)
@checkpoint_options(exclude=("stream",))  # how an image was written decides
@click.pass_context
def restore(
    ctx: click.Context, /, image: str, as_json: bool, name: str | None, **flags: Any
) -> None:
    """Restore the job whose image is in the directory or at the store URL IMAGE
    (``…/images/latest`` works); it continues where it stopped. A container's image (from
    ``checkpoint podman:NAME``) is restored as a new container of the same name."""
    if not image.strip():
        raise click.BadParameter(
            "is empty: give an image directory or a store URL (…/JOB/images/latest)",
            param_hint="IMAGE",
        )
    s = _settings(ctx, flags)
    if operations.is_url(image):
        if container_cli.restore(
            ctx, image, name=name, as_json=as_json, state_dir=s.state_dir, criu=s.criu
        ):
            return
        settings = load(ImageSettings, {}, config_file=config(ctx))
        pulled = asyncio.run(operations.restore(image, settings=s, image_settings=settings))
        if as_json:
            click.echo(json.dumps(pulled.to_json()))
        else:
            click.echo(
                f"job {pulled.job.name} restored from {pulled.image_url}: pid {pulled.pid}: "
                f"{_steps(pulled.timeline.to_list())}"
            )
        return
    if name is not None:
        raise click.BadParameter("is for a container image in a store", param_hint="--name")
    path = Path(image)
    if not path.is_dir():
        raise click.BadParameter(f"directory {image!r} does not exist", param_hint="IMAGE")
    result = asyncio.run(_engine(s).restore(DirectorySource(path.absolute())))
    if as_json:
        click.echo(json.dumps(result.to_json()))
    else:
        click.echo(
            f"job {result.job.name} restored: pid {result.pid}: {_steps(result.timeline.to_list())}"
        )
