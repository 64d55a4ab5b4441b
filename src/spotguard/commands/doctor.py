"""``spotguard doctor``: report CRIU, kernel, GPU/driver and the checkpoint API, with fixes, and
park and unpark a small job with sockets (the self-test)."""

from __future__ import annotations

import asyncio
import json
import sys

import click

from spotguard.checkpoint.doctor import run_checks
from spotguard.cli import verbose_option


@click.command("doctor")
@click.option(
    "--criu",
    "criu_path",
    envvar="SPOTGUARD_CRIU",
    help="CRIU executable to check. [env: SPOTGUARD_CRIU]",
)
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@click.option(
    "--self-test/--no-self-test",
    default=True,
    help="Park and unpark a small job with sockets on this host (default; a few seconds).",
)
@verbose_option
def doctor(criu_path: str | None, as_json: bool, self_test: bool) -> None:
    """Check what checkpoints need on this host; exit 1 if CPU checkpoints cannot work."""
    checks = asyncio.run(run_checks(criu_path, self_test=self_test))
    if as_json:
        click.echo(json.dumps([c.to_json() for c in checks], indent=2))
    else:
        for c in checks:
            mark = "ok  " if c.ok else ("FAIL" if c.required else "warn")
            click.echo(f"{mark} {c.name:<20} {c.found}")
            if not c.ok and c.fix:
                click.echo(f"     {'':<20} fix: {c.fix}")
    sys.exit(0 if all(c.ok for c in checks if c.required) else 1)
