"""``spotguard agent``, ``spotguard drain``, ``spotguard status`` and ``spotguard logs``.

``agent`` takes every setting of :class:`~spotguard.agent.settings.AgentSettings`, of the notice
sources (:class:`~spotguard.notices.settings.NoticeSettings`), of the engine
(:class:`~spotguard.checkpoint.settings.CheckpointSettings`) and of images
(:class:`~spotguard.image.settings.ImageSettings`) as flags; ``drain`` and ``status``
talk to a running agent through its local API, found with the same settings. The ``[planner]``
section reaches the agent's checkpoints from the same config file (no flags). ``logs``
reads a job's output files (they need no agent).

Exit status: 0 done; 1 a failure (one line on stderr); 2 bad usage or configuration
(a missing extra included); 3 the agent is not running (``status``, ``drain``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
from pathlib import Path
from typing import Any

import click

from spotguard.agent.settings import DRAIN_DEADLINE_MAX, AgentSettings, parse_listen, read_secret
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.cli import config, config_file
from spotguard.commands.common import no_inline_token
from spotguard.commands.joblogs import logs
from spotguard.config import load, options
from spotguard.errors import AgentNotRunning, ConfigError, SpotguardError
from spotguard.extras import require_for_store
from spotguard.image.settings import ImageSettings
from spotguard.notices.settings import NoticeSettings
from spotguard.notify import Notifier, NotifySettings
from spotguard.park.settings import ParkSettings
from spotguard.planner import PlannerSettings
from spotguard.statedir import StateDir

log = logging.getLogger(__name__)

__all__ = ["agent", "drain", "logs", "status"]

_API_ONLY = tuple(n for n in AgentSettings.model_fields if not n.startswith("api_"))
_STATE_ONLY = tuple(n for n in CheckpointSettings.model_fields if n != "state_dir")


@click.command("agent")
@options(AgentSettings, exclude=("controller_token",))  # a file or the environment: not ps
@no_inline_token("--controller-token")
@options(NoticeSettings)
@options(CheckpointSettings)
@options(ImageSettings)
@click.pass_context
def agent(ctx: click.Context, /, **flags: Any) -> None:
    """Protect jobs on this VM: watch notices, checkpoint, stream, report.

    Example: spotguard agent --job train --store s3://bucket/spotguard
    """
    from spotguard.agent.daemon import Agent

    cfg = config(ctx)  # read once; every settings group below comes from the same file
    settings = load(AgentSettings, flags, config_file=cfg)
    notices = load(NoticeSettings, flags, config_file=cfg)
    ckpt = load(CheckpointSettings, flags, config_file=cfg)
    image = load(ImageSettings, flags, config_file=cfg)
    planner = load(PlannerSettings, {}, config_file=cfg)
    notifier = Notifier(load(NotifySettings, {}, config_file=cfg))
    park = load(ParkSettings, {}, config_file=cfg)
    require_for_store(settings.store)  # refuse to start rather than fail at the first notice

    async def main() -> None:
        daemon = Agent(
            settings, ckpt, notices, image=image, planner=planner, notifier=notifier,
            park=park, config=config_file(ctx), config_file=cfg,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.request_stop)
        await daemon.run()

    asyncio.run(main())


def not_running(listen: str) -> AgentNotRunning:
    """The one message for "nothing answers on the agent's API"."""
    return AgentNotRunning(
        f"the spotguard agent is not running (nothing answers on {listen}): start it with "
        "'systemctl start spotguard-agent' (or 'spotguard agent'); "
        "'journalctl -u spotguard-agent' says why it stopped"
    )


def ensure_running(listen: str) -> None:
    """Raise :class:`AgentNotRunning` unless something accepts connections on ``listen``."""
    where = parse_listen(listen)
    family = socket.AF_UNIX if isinstance(where, Path) else socket.AF_INET
    if not isinstance(where, Path) and ":" in where[0]:
        family = socket.AF_INET6
    address: Any = str(where) if isinstance(where, Path) else where
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(2.0)
            sock.connect(address)
    except OSError:
        raise not_running(listen) from None


def _api(ctx: click.Context, flags: dict[str, Any]) -> tuple[str, str]:
    cfg = config(ctx)
    s = load(AgentSettings, flags, config_file=cfg)
    state = load(CheckpointSettings, flags, config_file=cfg).state_dir
    ensure_running(s.api_listen)
    token = read_secret(s.api_token, s.api_token_file, "api_token")
    if token is None:
        path = StateDir(Path(state)).api_token
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"cannot read the agent's API token {path} ({exc.strerror}): run as root "
                "(sudo spotguard ...) or set SPOTGUARD_API_TOKEN / --api-token-file"
            ) from exc
    return s.api_listen, token


@click.command("drain")
@click.option("--reason", default="operator drain", show_default=True, help="Why (logged).")
@click.option(
    "--deadline",
    type=click.FloatRange(0, DRAIN_DEADLINE_MAX, min_open=True),
    default=None,
    help="Seconds the node may take (at most a day).",
)
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait for the images.")
@click.option("--json", "as_json", is_flag=True, help="Print the agent's answer as JSON.")
@options(AgentSettings, exclude=_API_ONLY)
@options(CheckpointSettings, exclude=_STATE_ONLY)
@click.pass_context
def drain(
    ctx: click.Context,
    /,
    reason: str,
    deadline: float | None,
    wait: bool,
    as_json: bool,
    **flags: Any,
) -> None:
    """Ask the local agent to checkpoint its jobs and stop them (operator drain)."""
    from spotguard.agent.client import call

    listen, token = _api(ctx, flags)
    body = {"reason": reason, "wait": wait, "deadline_s": deadline}
    answer = asyncio.run(call(listen, token, "POST", "/drain", body))
    if as_json:
        click.echo(json.dumps(answer, indent=2))
    else:
        click.echo(f"drain {answer['notice']['id']} ({reason})")
        for r in answer.get("results", []):
            if r.get("error"):
                click.echo(f"  {r.get('job')}: FAILED {r['error']}")
            elif r.get("url"):
                click.echo(f"  {r['job']}: {r.get('state', 'done')} image {r['url']}")
            else:
                click.echo(f"  {r.get('job', '-')}: {r.get('state') or 'nothing to do'}")
    _drain_outcome(answer, wait)


def _drain_outcome(answer: dict[str, Any], wait: bool) -> None:
    """Exit 1 when a waited-for drain wrote no image: a job failed, or none was protected."""
    if not wait:
        return
    results = answer.get("results", [])
    failed = [r for r in results if r.get("error")]
    if failed:
        names = ", ".join(str(r.get("job", "?")) for r in failed)
        raise SpotguardError(
            f"drain failed for {names}: see 'spotguard status' and the agent's log"
        )
    if not any(r.get("url") for r in results):
        raise SpotguardError(
            "drain wrote no image: the agent protects no running job "
            "('spotguard status' lists what it protects)"
        )


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the agent's answer as JSON.")
@options(AgentSettings, exclude=_API_ONLY)
@options(CheckpointSettings, exclude=_STATE_ONLY)
@click.pass_context
def status(ctx: click.Context, /, as_json: bool, **flags: Any) -> None:
    """Show the local agent's jobs, last images and current activity."""
    from spotguard.agent.client import call

    listen, token = _api(ctx, flags)
    answer = asyncio.run(call(listen, token, "GET", "/status", timeout_s=10.0))
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    a = answer["agent"]
    click.echo(
        f"agent pid {a['pid']} cloud {a['cloud'] or 'none'} store {a['store']} "
        f"controller {a['controller'] or '-'} (reports pending: {a['reports_pending']})"
    )
    parked = answer.get("parked", [])
    jobs = [j for j in answer["jobs"] if j["job"] not in {p["job"] for p in parked}]
    unknown = [j["job"] for j in jobs if not j.get("last_image")]
    in_store = _store_images(ctx, a["store"], unknown) if unknown else {}
    for j in jobs:
        act = j.get("activity") or {}
        click.echo(
            f"  {j['job']:24} pid {j['pid']:<8} {j['state']:13} "
            f"{_last_image(j.get('last_image'), in_store.get(j['job']))}"
            + (f" now: {act.get('step')} for {act.get('notice')}" if act else "")
        )
        for p in j.get("pending", []):
            click.echo(f"      pending {p['notice']} {p['action']} at {p['start_at']}")
        for why in j.get("cannot_checkpoint", []):
            click.echo(f"      cannot be checkpointed as it is: {why}")
    if not jobs and not parked:
        click.echo("  no job protected")
    for p in parked:  # one row per parked job (the agent also lists it among its jobs)
        click.echo(
            f"  {p['job']:24} parked in {p['place']} ({p['where']}) since {p['since']}"
            + (f": {p['reason']}" if p["reason"] else "")
        )


def _last_image(last: dict[str, Any] | None, in_store: str | None) -> str:
    """The status row's image: the agent's newest, else the newest in the store."""
    if last:
        return f"last image {last.get('url', '-')} ({last.get('frozen_at', '?')})"
    if in_store:
        return f"last image {in_store} (in the store)"
    return "no image yet"


def _store_images(ctx: click.Context, store: str, jobs: list[str]) -> dict[str, str]:
    """The newest image in the store of each of ``jobs`` the agent wrote none of (written
    before it started, or by ``spotguard checkpoint``); none where the store does not answer
    within a few seconds (status never hangs on it)."""
    from spotguard.image.catalog import latest_image

    settings = load(ImageSettings, {}, config_file=config(ctx))

    async def one(job: str) -> str | None:
        try:
            return await asyncio.wait_for(latest_image(store, job, settings=settings), 5.0)
        except (SpotguardError, TimeoutError, ValueError) as exc:
            log.debug("no store image for status", extra={"job": job, "error": str(exc)})
            return None

    async def every() -> list[str | None]:
        return await asyncio.gather(*(one(j) for j in jobs))

    return {j: url for j, url in zip(jobs, asyncio.run(every()), strict=True) if url}
