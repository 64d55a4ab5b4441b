"""``spotguard notices watch|detect|facts``, ``spotguard notice send|update|cancel|list|fault|
instance|reset`` and ``spotguard metadata-sim``."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import click

from spotguard.cli import config
from spotguard.config import load, not_text, options
from spotguard.errors import ConfigError
from spotguard.notices.base import Notice
from spotguard.notices.settings import NoticeSettings
from spotguard.simulator.client import SIM_URL_ENV, SimClient
from spotguard.simulator.settings import SimSettings

T = TypeVar("T")


def run_until_signal(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """Run ``main(stop)`` on a fresh loop; SIGINT / SIGTERM set ``stop`` (a clean exit)."""

    async def runner() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            return await main(stop)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    return asyncio.run(runner())


def _line(notice: Notice) -> str:
    left = notice.seconds_left()
    what = "WITHDRAWN" if notice.cancelled else "NOTICE"
    stamp = notice.received_at.astimezone().strftime("%H:%M:%S")
    deadline = notice.to_json()["deadline"]
    return (
        f"{stamp} {what} {notice.cloud.value} {notice.kind.value}"
        f"{' ' + notice.action if notice.action else ''} deadline {deadline}"
        f" ({left:+.0f} s) id={notice.id}"
    )


# -- notices ---------------------------------------------------------------------------------


@click.group("notices", help="Watch interruption notices from the cloud's metadata service.")
def notices() -> None:
    pass


@notices.command("watch")
@options(NoticeSettings)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per notice and line.")
@click.pass_context
def watch(ctx: click.Context, /, as_json: bool, **flags: Any) -> None:
    """Print each notice (and each withdrawal) as it arrives, until Ctrl-C."""
    from spotguard.notices.bus import NoticeBus
    from spotguard.notices.factory import metadata_source

    settings = load(NoticeSettings, flags, config_file=config(ctx))

    async def main(stop: asyncio.Event) -> None:
        source = await metadata_source(settings)
        click.echo(f"watching {source.name} metadata notices (Ctrl-C to stop)", err=True)
        async with NoticeBus([source], backoff_max=settings.backoff_max) as bus:

            async def printer() -> None:
                async for notice in bus:
                    text = json.dumps(notice.to_json()) if as_json else _line(notice)
                    sys.stdout.write(text + "\n")
                    sys.stdout.flush()

            task = asyncio.create_task(printer())
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for t in (task, stopper):
                t.cancel()
            await asyncio.gather(task, stopper, return_exceptions=True)

    run_until_signal(main)


@notices.command("detect")
@options(NoticeSettings, exclude=("cloud",))
@click.pass_context
def detect(ctx: click.Context, /, **flags: Any) -> None:
    """Print which cloud's metadata service answers (exit 1 when none does)."""
    from spotguard.notices.factory import resolve_cloud

    settings = load(NoticeSettings, {**flags, "cloud": "auto"}, config_file=config(ctx))
    cloud = asyncio.run(resolve_cloud(settings))
    click.echo(cloud.value if cloud else "none")
    if cloud is None:
        sys.exit(1)


@notices.command("facts")
@options(NoticeSettings)
@click.option("--user-data", "with_user_data", is_flag=True, help="Also print the user-data.")
@click.pass_context
def facts(ctx: click.Context, /, with_user_data: bool, **flags: Any) -> None:
    """Print this instance's facts (type, zone, id, spot) as JSON (``local`` when no metadata
    service answers)."""
    from spotguard.notices.factory import resolve_cloud
    from spotguard.notices.instance import instance_facts, user_data

    settings = load(NoticeSettings, flags, config_file=config(ctx))

    async def main() -> dict[str, Any]:
        cloud = await resolve_cloud(settings)
        out = (await instance_facts(cloud, settings)).to_json()
        if with_user_data:
            out["user_data"] = await user_data(cloud, settings)
        return out

    click.echo(json.dumps(asyncio.run(main()), indent=2))


# -- notice (drive a metadata-sim) -----------------------------------------------------------


def _call(ctx: click.Context, fn: Callable[[SimClient], Awaitable[T]]) -> T:
    async def main() -> T:
        async with SimClient(ctx.obj["sim"]) as client:
            return await fn(client)

    return asyncio.run(main())


@click.group("notice", help="Send, change or cancel notices on a running metadata-sim.")
@click.option(
    "--sim",
    envvar=SIM_URL_ENV,
    default="http://127.0.0.1:1338",
    show_default=True,
    help=f"URL of the metadata-sim. [env: {SIM_URL_ENV}]",
)
@click.pass_context
def notice(ctx: click.Context, sim: str) -> None:
    ctx.obj = {**(ctx.obj or {}), "sim": sim}


@notice.command("send")
@click.option("--cloud", type=click.Choice(["aws", "gcp", "azure"]), required=True)
@click.option("--kind", type=click.Choice(["preempt", "rebalance", "maintenance"]), required=True)
@click.option("--action", help="The cloud's word: terminate|stop|hibernate, system-reboot, ...")
@click.option("--in", "in_seconds", type=float, help="Seconds until the event (its deadline).")
@click.option("--id", "notice_id", help="Choose the notice id (EventId).")
@click.option("--json", "as_json", is_flag=True, help="Print the whole notice as JSON.")
@click.pass_context
def send(
    ctx: click.Context,
    cloud: str,
    kind: str,
    action: str | None,
    in_seconds: float | None,
    notice_id: str | None,
    as_json: bool,
) -> None:
    """Inject a notice; prints its id."""
    sent = _call(
        ctx,
        lambda c: c.send(cloud, kind, action=action, in_seconds=in_seconds, notice_id=notice_id),
    )
    click.echo(json.dumps(sent) if as_json else sent["id"])


@notice.command("update")
@click.argument("notice_id")
@click.option("--action")
@click.option("--in", "in_seconds", type=float)
@click.option("--state", type=click.Choice(["active", "cancelled", "completed"]))
@click.pass_context
def update(
    ctx: click.Context,
    notice_id: str,
    action: str | None,
    in_seconds: float | None,
    state: str | None,
) -> None:
    """Change a notice's action, deadline or state."""
    changes = {
        k: v
        for k, v in (("action", action), ("in_seconds", in_seconds), ("state", state))
        if v is not None
    }
    click.echo(json.dumps(_call(ctx, lambda c: c.update(notice_id, **changes))))


@notice.command("cancel")
@click.argument("notice_id")
@click.pass_context
def cancel(ctx: click.Context, notice_id: str) -> None:
    """Withdraw a notice."""
    _call(ctx, lambda c: c.cancel(notice_id))
    click.echo(f"cancelled {notice_id}")


@notice.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """List the notices the metadata-sim holds."""
    items = _call(ctx, lambda c: c.notices())
    if as_json:
        click.echo(json.dumps(items))
        return
    for n in items:
        click.echo(
            f"{n['id']}  {n['cloud']:5} {n['kind']:11} {n['action']:30} {n['state']:9} "
            f"not_before {n['not_before']} ({n['in_seconds']:+.0f} s)"
        )


@notice.command("fault")
@click.option("--mode", type=click.Choice(["error", "garbage", "hang"]), required=True)
@click.option("--cloud", type=click.Choice(["aws", "gcp", "azure"]))
@click.option("--path", help="Only requests whose path contains this.")
@click.option("--status", type=int, default=503, show_default=True, help="HTTP status (error).")
@click.option("--count", type=int, help="For this many requests.")
@click.option("--seconds", type=float, help="For this long.")
@click.option("--hang", "hang_s", type=float, default=30.0, show_default=True)
@click.option("--clear", is_flag=True, help="Remove every fault instead.")
@click.pass_context
def fault(ctx: click.Context, /, mode: str, clear: bool, **opts: Any) -> None:
    """Make metadata requests fail (5xx, garbage, hang) to rehearse outages."""
    if clear:
        _call(ctx, lambda c: c.clear_faults())
        click.echo("faults cleared")
        return
    body = {k: v for k, v in opts.items() if v is not None}
    click.echo(json.dumps(_call(ctx, lambda c: c.fault(mode, **body))))


@notice.command("reset")
@click.pass_context
def reset(ctx: click.Context) -> None:
    """Drop every notice, fault and token."""
    _call(ctx, lambda c: c.reset())
    click.echo("reset")


# -- metadata-sim ----------------------------------------------------------------------------


def _user_data(value: str | None) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read user-data file {value[1:]}: {exc}") from exc
    except UnicodeDecodeError as exc:  # the emulator serves user-data as text
        raise ConfigError(f"user-data file {value[1:]}: {not_text(exc)}") from exc


@click.command("metadata-sim")
@options(SimSettings)
@click.pass_context
def metadata_sim(ctx: click.Context, /, **flags: Any) -> None:
    """Serve AWS IMDSv2, GCP metadata and Azure Scheduled Events on one port, with a control
    API (/_sim) to inject, change and cancel notices and faults while it runs."""
    from spotguard.simulator import MetadataSim, SimFacts

    s = load(SimSettings, flags, config_file=config(ctx))
    facts = SimFacts(
        instance_id=s.instance_id,
        instance_type=s.instance_type,
        zone=s.zone,
        region=s.region,
        spot=s.spot,
        user_data=_user_data(s.user_data),
        attributes=dict(a.split("=", 1) for a in s.attribute),
    )

    async def main(stop: asyncio.Event) -> None:
        sim = MetadataSim(
            s.host,
            s.port,
            clouds=tuple(s.clouds.split(",")),
            facts=facts,
            max_token_ttl=s.max_token_ttl,
            imdsv1=s.imdsv1,
        )
        try:
            await sim.start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {s.host}:{s.port}: {exc}") from exc
        try:
            started = datetime.now(UTC).strftime("%H:%M:%S")
            click.echo(f"metadata-sim serving {s.clouds} on {sim.url} (since {started} UTC)")
            for key, value in sim.env().items():
                click.echo(f"export {key}={value}")
            sys.stdout.flush()
            await stop.wait()
        finally:
            await sim.stop()

    run_until_signal(main)
