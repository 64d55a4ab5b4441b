"""``spotguard controller``, ``spotguard jobs list|show`` and ``spotguard migrate``."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import click

from spotguard.cli import config_file
from spotguard.config import load, options
from spotguard.controller.client import ControllerClient
from spotguard.controller.settings import ClientSettings, ControllerSettings
from spotguard.notices.fleet import FleetSettings
from spotguard.notify import Notifier, NotifySettings


@click.command("controller")
@options(ControllerSettings, exclude=("state", "controller_token"))
@options(FleetSettings)
@click.option(
    "--state",
    "state",
    type=click.Path(dir_okay=False),
    default=None,
    help="SQLite state file. [default: STATE_DIR/controller.db] [env: SPOTGUARD_STATE]",
)
@click.option(
    "--token",
    "controller_token",
    default=None,
    help="Bearer token agents and the CLI must send. [env: SPOTGUARD_CONTROLLER_TOKEN]",
)
@click.pass_context
def controller(ctx: click.Context, /, **flags: Any) -> None:
    """Run the controller: relaunch matching instances and restore jobs.

    With a fleet queue (--queue-url, SPOTGUARD_FLEET_QUEUE_URL or [fleet] queue_url) it also
    reads EC2 interruption events routed by EventBridge to SQS, so a job is recovered even
    when its agent died with the VM.
    """
    from spotguard.controller.server import serve_forever
    from spotguard.notices.fleet import SqsFleetSource

    cfg = config_file(ctx)
    settings = load(ControllerSettings, flags, config_file=cfg)
    fleet = load(FleetSettings, flags, config_file=cfg)
    settings.token()  # refuse to start without one
    notifier = Notifier(load(NotifySettings, {}, config_file=cfg))
    source = SqsFleetSource.from_settings(fleet)
    asyncio.run(
        serve_forever(
            settings, cfg, sources=[source] if source is not None else [], notifier=notifier
        )
    )


def _client(ctx: click.Context, flags: dict[str, Any]) -> ControllerClient:
    s = load(ClientSettings, flags, config_file=config_file(ctx))
    return ControllerClient(s.controller_url, s.controller_token)


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


@click.group("jobs")
def jobs() -> None:
    """List and show jobs known to the controller."""


@jobs.command("list")
@options(ClientSettings)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def jobs_list(ctx: click.Context, /, as_json: bool, **flags: Any) -> None:
    """Every job: state, where it runs, restarts, newest image."""
    data = asyncio.run(_client(ctx, flags).get("/v1/jobs"))
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    rows = data.get("jobs", [])
    if not rows:
        click.echo("no jobs")
        return
    click.echo(f"{'JOB':24} {'STATE':13} {'INSTANCE':24} {'RESTARTS':>8}  REASON")
    for j in rows:
        inst = (j.get("pending") or j.get("instance") or {}).get("instance_id") or "-"
        click.echo(f"{j['job']:24} {j['state']:13} {inst:24} {j['restarts']:>8}  {j['reason']}")


@jobs.command("show")
@click.argument("job")
@options(ClientSettings)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def jobs_show(ctx: click.Context, /, job: str, as_json: bool, **flags: Any) -> None:
    """One job: state, history timeline, current instance, images."""
    v = asyncio.run(_client(ctx, flags).get(f"/v1/jobs/{job}"))
    if as_json:
        click.echo(json.dumps(v, indent=2))
        return
    inst = v.get("instance") or {}
    click.echo(f"job       {v['name']}")
    click.echo(f"state     {v['state']}  (since {_when(v.get('since'))})  {v.get('reason', '')}")
    click.echo(
        f"instance  {inst.get('instance_id') or '-'}  {inst.get('instance_type') or ''} "
        f"{inst.get('zone') or ''}".rstrip()
    )
    if v.get("pending"):
        p = v["pending"]
        click.echo(
            f"launching {p['instance_id']}  {p['instance_type']} {p['zone']} ({p['market']})"
        )
    click.echo(f"restarts  {v['restarts']}")
    click.echo(f"image     {v.get('image_url') or '-'}")
    click.echo("history:")
    for h in v.get("history", []):
        move = h["to"] if h["from"] in (None, h["to"]) else f"{h['from']} -> {h['to']}"
        click.echo(f"  {_when(h['at'])}  {move:28} {h['reason']}")
    if v.get("images"):
        click.echo("images:")
        for i in v["images"]:
            click.echo(f"  {_when(i['at'])}  {i['image_url']}")


@click.command("migrate")
@click.argument("job")
@click.option("--to", "to", required=True, help="Target region or instance type.")
@click.option(
    "--now",
    "immediate",
    is_flag=True,
    help="Relaunch from the newest durable image now instead of asking the agent to drain.",
)
@options(ClientSettings)
@click.pass_context
def migrate(ctx: click.Context, /, job: str, to: str, immediate: bool, **flags: Any) -> None:
    """Move JOB to another region or instance type (bursting, rightsizing)."""
    body = {"to": to, "immediate": immediate}
    r = asyncio.run(_client(ctx, flags).post(f"/v1/jobs/{job}/migrate", body))
    click.echo(f"{r['job']}: {r['state']} — {r['reason']}")
