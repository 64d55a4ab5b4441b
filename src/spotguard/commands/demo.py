"""``spotguard demo``: save a job from a spot interruption end to end, on this machine alone.

Runs :func:`spotguard.demo.scenario.run_demo` with the flags below, shows its progress (live on
a terminal, one line per event otherwise; on stderr with ``--json``), then the timeline and the
proof — or the one reason it failed. Exit status 0 only if every step held.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import click

from spotguard.demo.options import CLOUDS, FAULTS, KINDS, STORES, DemoOptions


@click.command("demo")
@click.option(
    "--cloud",
    type=click.Choice(CLOUDS),
    default="aws",
    show_default=True,
    help="Whose metadata service sends the notice (its shape and timing).",
)
@click.option(
    "--kind",
    type=click.Choice(KINDS),
    default="preempt",
    show_default=True,
    help="Notice kind: preempt / maintenance relaunch on VM 2; rebalance "
    "checkpoints and resumes on VM 1 (AWS only).",
)
@click.option(
    "--drain",
    is_flag=True,
    help="Instead of a cloud notice, drain VM 1 through the agent's local API.",
)
@click.option(
    "--store",
    type=click.Choice(STORES),
    default="file",
    show_default=True,
    help="Image store: a file:// directory, or S3 on a local moto server.",
)
@click.option("--steps", type=int, default=60, show_default=True, help="Steps the job runs.")
@click.option(
    "--step-seconds", type=float, default=0.1, show_default=True, help="Seconds each step takes."
)
@click.option("--mb", type=int, default=32, show_default=True, help="MiB of state the job holds.")
@click.option("--seed", type=int, default=1234, show_default=True, help="The job's seed.")
@click.option(
    "--gpu",
    type=click.Choice(["auto", "yes", "no"]),
    default="auto",
    show_default=True,
    help="Keep the job's state on the GPU (PyTorch + CUDA).",
)
@click.option(
    "--notice-at",
    type=int,
    default=None,
    help="Send the notice once the job printed this step [default: a third in].",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Empty directory for the run's files [default: a new temporary one].",
)
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the work dir (logs, store, VMs) afterwards; a failed run always does.",
)
@click.option(
    "--fault",
    type=click.Choice(FAULTS),
    default=None,
    help="Break one link on purpose (store unwritable, VM launch fails, restore "
    "fails, metadata service errors) to see the demo fail loudly.",
)
@click.option(
    "--stage-timeout",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds each stage may take before the demo calls it broken.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print a machine-readable summary on stdout (progress goes to stderr).",
)
@click.option(
    "--container",
    is_flag=True,
    help="Protect a container instead of a process (podman unless --runtime says otherwise; "
    "needs scripts/install-podman; takes only --workdir, --keep, --json and --runtime; "
    "docs/containers.md).",
)
@click.option(
    "--runtime",
    type=click.Choice(["podman", "containerd", "docker"]),
    default="podman",
    show_default=True,
    help="With --container: the container runtime (containerd and docker need "
    "scripts/install-containerd, scripts/install-docker).",
)
@click.pass_context
def demo(ctx: click.Context, /, as_json: bool, container: bool, runtime: str, **flags: Any) -> None:
    """Save a job from a spot interruption end to end, on this machine alone.

    Starts the metadata emulator, a store, the controller with the local provider, an agent on
    "VM 1" and a training-like job; injects a notice; follows freeze, upload, relaunch and
    restore; then proves the job on "VM 2" printed exactly what an uninterrupted run prints.
    Needs Linux, root and CRIU >= 4.2.1 (scripts/install-criu). Example: spotguard demo --cloud gcp
    """
    if container:
        from spotguard.container.cli import demo as container_demo

        ok = container_demo(
            ctx, as_json=as_json, workdir=flags["workdir"], keep=flags["keep"], runtime=runtime
        )
        sys.exit(0 if ok else 1)
    if runtime != "podman":
        raise click.UsageError("--runtime goes with --container")
    from spotguard.cli import config
    from spotguard.config import load
    from spotguard.demo.scenario import run_demo
    from spotguard.demo.ui import make_ui, render_report
    from spotguard.image.settings import ImageSettings

    opts = DemoOptions(**flags)
    image = load(ImageSettings, {}, config_file=config(ctx))
    progress_out = sys.stderr if as_json else sys.stdout
    ui = make_ui(progress_out, live=True)

    async def main() -> Any:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await run_demo(opts, ui, image)

    try:
        report = asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        ui.close()
        click.echo("spotguard: demo interrupted; every process it started was stopped", err=True)
        sys.exit(130)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2, default=str))
    else:
        render_report(report, sys.stdout)
    if not report.ok:
        if as_json:
            click.echo(f"spotguard: demo FAILED at {report.failed_step}: {report.reason}", err=True)
        sys.exit(1)
