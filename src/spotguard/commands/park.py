"""``spotguard park``, ``spotguard unpark`` and the wake-on-connect listener ``park-wake``.

Settings are loaded here, once, and passed down (:mod:`spotguard.park` reads none itself).
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from spotguard.checkpoint.engine import Engine
from spotguard.checkpoint.jobs import list_jobs, resolve_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.cli import config, config_file
from spotguard.commands.common import ADVANCED, checkpoint_options
from spotguard.config import ConfigFile, load, options
from spotguard.container import cli as container_cli
from spotguard.container.spec import is_container_job
from spotguard.errors import ParkError
from spotguard.image.settings import ImageSettings
from spotguard.notify import Notifier, NotifySettings
from spotguard.park import core, record, wake
from spotguard.park.policy import ParkPolicy
from spotguard.park.priority import Claim
from spotguard.park.service import ParkService, spawn_waker, webhooks
from spotguard.park.settings import ParkSettings
from spotguard.park.store import store_path

if TYPE_CHECKING:
    from spotguard.agent.settings import AgentSettings


@dataclass(frozen=True)
class _Ctx:
    cs: CheckpointSettings
    ps: ParkSettings
    image: ImageSettings
    engine: Engine
    config: str | None  # the --config given (handed to the wake-on-connect listener)
    notify: NotifySettings
    file: ConfigFile  # the config file, read once for this command line


def _engine_for(cs: CheckpointSettings) -> Engine:
    from spotguard.operations import engine_for

    return engine_for(cs)


def _ctx(ctx: click.Context, flags: dict[str, Any]) -> _Ctx:
    cfg = config(ctx)
    cs = load(CheckpointSettings, flags, config_file=cfg)
    return _Ctx(
        cs,
        load(ParkSettings, flags, config_file=cfg),
        load(ImageSettings, {}, config_file=cfg),
        _engine_for(cs),
        config_file(ctx),
        load(NotifySettings, {}, config_file=cfg),
        cfg,
    )


def _agent_settings(c: _Ctx) -> AgentSettings:
    """This node's agent settings: where a park to a store is reported (the controller)."""
    from spotguard.agent.settings import AgentSettings

    return load(AgentSettings, {}, config_file=c.file)


def _service(c: _Ctx) -> ParkService:
    """The park service of this command: the webhooks told, wake-on-connect listeners
    started with the ``--config`` given, a store park reported to this node's controller
    (its agent settings), which is asked before a store park is unparked here."""

    async def notify(event: str, details: dict[str, Any]) -> None:
        # tell the webhooks ([notify]); the message goes out before the command ends
        notifier = Notifier(c.notify)
        await webhooks(notifier)(event, details)
        await notifier.aclose()

    return ParkService(
        settings=c.ps,
        checkpoint=c.cs,
        engine=c.engine,
        store=store_path(c.cs, c.image, c.engine),
        notify=notify,
        start_waker=spawn_waker(c.cs.state_dir, c.config),
        controller=lambda: _agent_settings(c),
        report=True,
    )


def _summary(rec: record.ParkRecord) -> dict[str, Any]:
    return {
        "job": rec.job,
        "parked": True,
        "where": rec.location,
        "place": rec.place,
        "bytes": rec.bytes,
        "gpu_memory_freed": rec.gpu_bytes_freed,
        "seconds": rec.park_seconds,
        "since": rec.since.isoformat(),
        "reason": rec.reason,
        "listen": [str(a.address()) for a in rec.listen],
        "wake_on_connect": rec.wake_on_connect,
        "waker_pid": rec.waker_pid,
    }


@click.command("park", epilog=ADVANCED)
@click.argument("job")
@click.option(
    "--to",
    "to",
    default=None,
    help=(
        "memory (suspended in place, fastest back), tmpfs or disk (an image in memory or on "
        "disk; the processes end), or a store URL. [default: [park] to = memory]"
    ),
)
@click.option(
    "--wake-on-connect",
    is_flag=True,
    help="Listen on the job's TCP ports while parked; the first client unparks it.",
)
@click.option("--reason", default="", help="Why (shown in status and notifications).")
@click.option("--json", "as_json", is_flag=True, help="Print where, bytes, GPU memory freed, time.")
@checkpoint_options(exclude=("stream",))
@click.pass_context
def park(
    ctx: click.Context,
    /,
    job: str,
    to: str | None,
    wake_on_connect: bool,
    reason: str,
    as_json: bool,
    **flags: Any,
) -> None:
    """Free JOB's GPU and CPU and keep its exact state (in memory, on disk or in a store).

    The job stops; `spotguard unpark JOB` brings it back where it stopped. Example:
    spotguard park notebook --to memory --wake-on-connect --reason "idle since lunch"
    """
    c = _ctx(ctx, flags)
    if is_container_job(job):
        container_cli.park(
            ctx,
            job,
            to or c.ps.to,
            reason=reason,
            as_json=as_json,
            state_dir=c.cs.state_dir,
            criu=c.cs.criu,
        )
        return
    info = resolve_job(job, state_dir=c.cs.state_dir)
    core.place_of(to or c.ps.to)  # a bad --to is refused before anything else
    service = _service(c)
    done = asyncio.run(service.park(info, reason, wake=wake_on_connect, to=to))
    rec, told = done.record, done.controller
    out = _summary(rec) | ({"controller": told} if told else {})
    if as_json:
        click.echo(json.dumps(out))
        return
    wake_note = f"; wakes on connect to {', '.join(out['listen'])}" if rec.wake_on_connect else ""
    if told:
        wake_note += f"; controller: {told}"
    click.echo(
        f"job {rec.job} parked to {rec.place} ({rec.location}): {rec.bytes / 2**20:.1f} MiB "
        f"held, {rec.gpu_bytes_freed / 2**20:.0f} MiB of GPU memory freed, "
        f"{rec.park_seconds:.2f} s{wake_note}"
    )


@click.command("unpark", epilog=ADVANCED)
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="Print the restored job as JSON.")
@checkpoint_options(exclude=("stream",))
@click.pass_context
def unpark(ctx: click.Context, /, job: str, as_json: bool, **flags: Any) -> None:
    """Bring a parked JOB back on this node; it continues where it stopped."""
    c = _ctx(ctx, flags)
    if is_container_job(job):
        container_cli.unpark(ctx, job, as_json=as_json, state_dir=c.cs.state_dir, criu=c.cs.criu)
        return

    service = _service(c)
    done = asyncio.run(service.unpark(job, reason=lambda d: f"pid {d.pid}"))
    if as_json:
        click.echo(json.dumps(done.to_json()))
    else:
        click.echo(
            f"job {done.job} unparked from {done.place}: pid {done.pid}, {done.seconds:.2f} s"
        )


@click.command("park-wake", hidden=True)
@click.argument("job")
@options(CheckpointSettings, exclude=("stream",))
@click.pass_context
def park_wake(ctx: click.Context, /, job: str, **flags: Any) -> None:
    """Hold a parked JOB's ports; unpark it when a client connects (started by park)."""
    c = _ctx(ctx, flags)
    rec = record.load(c.cs.state_dir, job)
    if rec is None or not rec.listen:
        raise ParkError(f"job {job!r} is not parked with ports to wake on")
    addrs = [a.address() for a in rec.listen]

    def ready() -> None:
        with record.locked(c.cs.state_dir, job):
            now = record.load(c.cs.state_dir, job)
            if now is not None:
                record.save(c.cs.state_dir, now.model_copy(update={"waker_pid": os.getpid()}))

    service = _service(c)

    async def wake_job() -> None:
        # waits for an unpark under way, then finds the job running: see wake.serve; woken
        # by a client, the webhooks hear it as from 'spotguard unpark' (an unpark by hand
        # that came first raised, and sent its own)
        await service.unpark(job, reason=lambda d: f"pid {d.pid}, woken by a client connecting")

    if rec.place == "memory":
        from spotguard.checkpoint import proctree

        def tree() -> list[int]:
            return proctree.tree(rec.pid) if proctree.alive(rec.pid) else []

        asyncio.run(wake.serve_in_place(tree, wake_job, ready=ready))
    else:

        def parked() -> bool:
            return record.load(c.cs.state_dir, job) is not None

        asyncio.run(wake.serve(addrs, wake_job, parked=parked, ready=ready))


def parked_rows(state_dir: Path) -> list[dict[str, Any]]:
    """Every parked job of this node, as ``status`` shows it."""
    return [_summary(r) for r in record.all_records(state_dir)]


def _size(text: str | None) -> int:
    """``40G``, ``512M``, ``1.5GiB``, a plain byte count → bytes (binary units)."""
    if not text:
        return 0
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    try:
        if t and t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        return int(t)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 40G, 512M)") from exc


def make_room(
    ctx: click.Context, cs: CheckpointSettings, prio: int, gpu_memory: str | None, for_job: str
) -> tuple[Claim, list[str]]:
    """For ``run --priority``: park lower-priority jobs of this node until the new job's GPU
    memory fits; the claim to record with the job and the jobs parked."""
    cfg = config(ctx)
    ps = load(ParkSettings, {}, config_file=cfg)
    c = _Ctx(
        cs, ps, load(ImageSettings, {}, config_file=cfg), _engine_for(cs), config_file(ctx),
        load(NotifySettings, {}, config_file=cfg), cfg,
    )  # fmt: skip
    claim = Claim(prio, _size(gpu_memory))
    service = ParkService(
        settings=ps, checkpoint=cs, engine=c.engine, store=store_path(cs, c.image, c.engine)
    )
    policy = ParkPolicy(service=service, jobs=lambda: list_jobs(cs.state_dir))
    return claim, asyncio.run(policy.make_room(claim, for_job))
