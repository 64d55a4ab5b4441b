"""``spotguard controller``, ``spotguard jobs list|show|unpark`` and ``spotguard migrate``."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime
from typing import Any

import click

from spotguard.cli import config
from spotguard.commands.common import job_name, no_inline_token
from spotguard.config import load, options
from spotguard.contracts import EventAnswer
from spotguard.controller.client import ControllerClient
from spotguard.controller.settings import ClientSettings, ControllerSettings
from spotguard.notices.fleet import FleetSettings
from spotguard.notify import Notifier, NotifySettings

log = logging.getLogger(__name__)


@click.command("controller")
@options(
    ControllerSettings,
    exclude=("state", "controller_token", "vm_signing_key_sources", "vm_verify_key_sources"),
)
@options(FleetSettings)
@click.option(
    "--state",
    "state",
    type=click.Path(dir_okay=False),
    default=None,
    help="SQLite state file. [default: STATE_DIR/controller.db] [env: SPOTGUARD_STATE]",
)
@no_inline_token("--token")  # the admin token: a file or the environment, never ps
@no_inline_token("--controller-token")
@click.option(
    "--issue-token",
    "issue_token",
    default=None,
    metavar="JOB",
    callback=job_name,
    help="Print a VM token for JOB (its first instance: --epoch 0) and exit.",
)
@click.option("--epoch", "epoch", type=click.IntRange(min=0), default=0, help="With --issue-token.")
@click.pass_context
def controller(ctx: click.Context, /, issue_token: str | None, epoch: int, **flags: Any) -> None:
    """Run the controller: relaunch matching instances and restore jobs.

    With a fleet queue (--queue-url, SPOTGUARD_FLEET_QUEUE_URL or [fleet] queue_url) it also
    reads EC2 interruption events routed by EventBridge to SQS, so a job is recovered even
    when its agent died with the VM.

    Serves HTTPS with --tls-cert-file/--tls-key-file; refuses a non-loopback --listen
    without them unless --insecure-listen (behind a TLS proxy). See docs/security.md.
    """
    from spotguard.controller.server import serve_forever
    from spotguard.image.settings import ImageSettings
    from spotguard.notices.fleet import SqsFleetSource
    from spotguard.providers import open_provider, provider_settings

    cfg = config(ctx)  # read once; every settings group below comes from the same file
    settings = load(ControllerSettings, flags, config_file=cfg)
    keys = settings.token_keys()  # refuse to start without an admin token
    if issue_token is not None:
        click.echo(keys.issue(issue_token, epoch))
        return
    settings.tls()  # refuse a bad certificate or a public plain-HTTP listen before anything
    fleet = load(FleetSettings, flags, config_file=cfg)
    notifier = Notifier(load(NotifySettings, {}, config_file=cfg))
    image = load(ImageSettings, config_file=cfg)
    provider = open_provider(load(provider_settings(settings.provider), config_file=cfg))
    source = SqsFleetSource.from_settings(fleet)
    sources = [source] if source is not None else []
    asyncio.run(serve_forever(settings, provider, image=image, sources=sources, notifier=notifier))


def _client(ctx: click.Context, flags: dict[str, Any]) -> ControllerClient:
    s = load(ClientSettings, flags, config_file=config(ctx))
    return ControllerClient(s.controller_url, s.bearer(), ca_file=s.controller_ca_file)


def _said(answer: EventAnswer) -> dict[str, Any]:
    """A job's summary as the controller sent it (the fields it sent, for ``--json``)."""
    return answer.model_dump(mode="json", exclude_unset=True)


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


@click.group("jobs")
def jobs() -> None:
    """List and show jobs known to the controller; unpark a job parked to a store; retry a
    failed job."""


@jobs.command("list")
@options(ClientSettings, exclude=("controller_token",))
@no_inline_token("--controller-token")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def jobs_list(ctx: click.Context, /, as_json: bool, **flags: Any) -> None:
    """Every job: state, where it runs, restarts, newest image."""
    rows = asyncio.run(_client(ctx, flags).jobs())
    if as_json:
        click.echo(json.dumps({"jobs": [_said(j) for j in rows]}, indent=2))
        return
    if not rows:
        click.echo("no jobs")
        return
    click.echo(f"{'JOB':24} {'STATE':13} {'INSTANCE':24} {'RESTARTS':>8}  REASON")
    for j in rows:
        where = j.pending or (j.instance.model_dump() if j.instance else {})
        inst = where.get("instance_id") or "-"
        click.echo(f"{j.job:24} {j.state:13} {inst!s:24} {j.restarts:>8}  {j.reason}")


@jobs.command("show")
@click.argument("job")
@options(ClientSettings, exclude=("controller_token",))
@no_inline_token("--controller-token")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def jobs_show(ctx: click.Context, /, job: str, as_json: bool, **flags: Any) -> None:
    """One job: state, history timeline, current instance, images."""
    v = asyncio.run(_client(ctx, flags).job(job))
    if as_json:
        click.echo(json.dumps(v.to_json(), indent=2))
        return
    inst = v.instance
    click.echo(f"job       {v.name}")
    click.echo(f"state     {v.state}  (since {_when(v.since)})  {v.reason}")
    click.echo(
        f"instance  {inst.get('instance_id') or '-'}  {inst.get('instance_type') or ''} "
        f"{inst.get('zone') or ''}".rstrip()
    )
    if v.pending:
        p = v.pending
        click.echo(
            f"launching {p['instance_id']}  {p['instance_type']} {p['zone']} ({p['market']})"
        )
    click.echo(f"restarts  {v.restarts}")
    click.echo(f"image     {v.image_url or '-'}")
    click.echo("history:")
    for h in v.history:
        move = h.to if h.from_state in (None, h.to) else f"{h.from_state} -> {h.to}"
        click.echo(f"  {_when(h.at)}  {move:28} {h.reason}")
    if v.images:
        click.echo("images:")
        for i in v.images:
            click.echo(f"  {_when(i.at)}  {i.image_url}")


def _relaunch(
    ctx: click.Context, flags: dict[str, Any], job: str, action: str, to: str | None, as_json: bool
) -> None:
    """Ask the controller for a new launch round of JOB (``unpark``, ``retry``), optionally
    ``to`` a region or instance type, and print the job's summary."""
    client = _client(ctx, flags)
    call = client.unpark if action == "unpark" else client.retry
    r = asyncio.run(call(job, to))
    if as_json:
        click.echo(json.dumps(_said(r), indent=2))
        return
    click.echo(f"{r.job}: {r.state} — {r.reason}")


@jobs.command("unpark")
@click.argument("job")
@click.option(
    "--to",
    "to",
    default=None,
    metavar="REGION|TYPE",
    help="Bring the job back in this region or on this instance type (checked first).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the job's summary as JSON.")
@options(ClientSettings, exclude=("controller_token",))
@no_inline_token("--controller-token")
@click.pass_context
def jobs_unpark(
    ctx: click.Context, /, job: str, to: str | None, as_json: bool, **flags: Any
) -> None:
    """Bring back JOB, parked to a store, on a new instance (any node can restore it).

    The controller relaunches it as it recovers an interrupted job: a new instance that
    restores the parked image. Example: spotguard jobs unpark notebook --to g5.2xlarge
    """
    _relaunch(ctx, flags, job, "unpark", to, as_json)


@jobs.command("retry")
@click.argument("job")
@click.option(
    "--to",
    "to",
    default=None,
    metavar="REGION|TYPE",
    help="Relaunch the job in this region or on this instance type (checked first).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the job's summary as JSON.")
@options(ClientSettings, exclude=("controller_token",))
@no_inline_token("--controller-token")
@click.pass_context
def jobs_retry(
    ctx: click.Context, /, job: str, to: str | None, as_json: bool, **flags: Any
) -> None:
    """Relaunch a FAILED JOB from its newest image, with a fresh restart budget.

    The controller gave up on it (max restarts in a row, no capacity, a refused launch);
    once the cause is fixed this starts a new launch round as a recovery does. Images known
    bad stay refused. Example: spotguard jobs retry train --to g5.2xlarge
    """
    _relaunch(ctx, flags, job, "retry", to, as_json)


@click.command("migrate")
@click.argument("job")
@click.option("--to", "to", required=True, help="Target region or instance type.")
@click.option(
    "--now",
    "immediate",
    is_flag=True,
    help="Relaunch from the newest durable image now instead of asking the agent to drain.",
)
@options(ClientSettings, exclude=("controller_token",))
@no_inline_token("--controller-token")
@click.pass_context
def migrate(ctx: click.Context, /, job: str, to: str, immediate: bool, **flags: Any) -> None:
    """Move JOB to another region or instance type (bursting, rightsizing)."""
    r = asyncio.run(_client(ctx, flags).migrate(job, to, immediate=immediate))
    click.echo(f"{r.job}: {r.state} — {r.reason}")
