"""The ``spotguard`` command line.

Each command lives in a module of :mod:`spotguard.commands` and is imported only when run,
so ``spotguard --help`` stays fast and cloud SDKs load only for the commands that need them.
Any :class:`~spotguard.errors.SpotguardError` ends the command with one clear line on stderr
and the error's exit code — never a traceback.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import TYPE_CHECKING, Any

import click

from spotguard import log
from spotguard.errors import SpotguardError

if TYPE_CHECKING:  # the settings machinery (pydantic) loads only for commands that use it
    from spotguard.config import ConfigFile

#: command name → "module:attribute" under spotguard.commands
COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "checkpoint",
        "run",
    ),
    "checkpoint": ("checkpoint", "checkpoint"),
    "restore": ("checkpoint", "restore"),
    "doctor": ("doctor", "doctor"),
    "images": ("images", "images"),
    "notices": ("notices", "notices"),
    "notice": ("notices", "notice"),
    "metadata-sim": ("notices", "metadata_sim"),
    "agent": ("agent", "agent"),
    "drain": ("agent", "drain"),
    "status": ("agent", "status"),
    "controller": ("controller", "controller"),
    "jobs": ("controller", "jobs"),
    "migrate": ("controller", "migrate"),
    "demo": ("demo", "demo"),
    "park": ("park", "park"),
    "unpark": ("park", "unpark"),
    "park-wake": ("park", "park_wake"),
    "logs": ("agent", "logs"),
    "install": ("install", "install"),
    "install-criu": ("install", "install_criu"),
    "install-nccl-shim": ("install", "install_nccl_shim"),
    "fetch-keys": ("keys", "fetch_keys_cmd"),
}

HELP = {
    "run": "Start a job so that it can be checkpointed and restored elsewhere.",
    "checkpoint": "Freeze a job (CPU + GPU) and write its image to a directory or store URL.",
    "restore": "Restore a job from an image directory or store URL.",
    "doctor": "Check CRIU, kernel, GPU driver and checkpoint API; hint at fixes.",
    "images": "List, verify and garbage-collect checkpoint images in a store.",
    "notices": "Watch interruption notices from the cloud's metadata service.",
    "notice": "Send, change or cancel notices on a running metadata-sim.",
    "metadata-sim": "Serve AWS/GCP/Azure metadata endpoints with injectable notices.",
    "agent": "Protect jobs on this VM: watch notices, checkpoint, stream, report.",
    "drain": "Ask the local agent to checkpoint its jobs and exit (operator drain).",
    "status": "Show the local agent's jobs, last images and current activity.",
    "controller": "Run the controller: relaunch matching instances and restore jobs.",
    "jobs": "List and show jobs known to the controller.",
    "migrate": "Move a job to another region or instance type on demand.",
    "demo": "Save a job from a spot interruption end to end, on this machine alone.",
    "park": "Free a job's GPU and CPU, keeping its exact state in memory, on disk or in a store.",
    "unpark": "Bring a parked job back on this node; it continues where it stopped.",
    "logs": "Print a job's output (stdout and stderr); -f follows it.",
    "install": "Link spotguard into /usr/local/bin, install its systemd units and config.",
    "install-criu": "Install CRIU >= 4.2.1 (the installer shipped with this package).",
    "install-nccl-shim": "Build spotguard's NCCL shim (NCCL keeps its fast transports).",
    "fetch-keys": "Fetch the fleet's image signing and verify keys onto this VM (at boot).",
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target
        try:
            module = importlib.import_module(f"spotguard.commands.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("spotguard"):
                return _unavailable(cmd_name, str(exc))
            raise
        cmd = getattr(module, attr)
        assert isinstance(cmd, click.Command)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # commands without a HELP line (park-wake: started by park itself) are not listed
        rows = [(name, HELP[name]) for name in self.list_commands(ctx) if name in HELP]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SpotguardError as exc:
            logging.getLogger("spotguard").debug("command failed", exc_info=True)
            click.echo(f"spotguard: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:
            # A bug or an unmapped low-level error: still one line (the traceback at debug).
            level = str(ctx.params.get("log_level") or "").upper()
            if level == "DEBUG" or logging.getLogger("spotguard").isEnabledFor(logging.DEBUG):
                raise
            click.echo(
                f"spotguard: error: {type(exc).__name__}: {exc} "
                "(unexpected; --log-level debug shows where)",
                err=True,
            )
            sys.exit(1)


def _unavailable(name: str, why: str) -> click.Command:
    @click.command(name, help=HELP.get(name))
    def cmd() -> None:
        raise click.ClickException(f"'{name}' is not available in this build ({why})")

    return cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="spotguard")
@click.option(
    "--config",
    "config",
    envvar="SPOTGUARD_CONFIG",
    type=click.Path(dir_okay=False),
    help="TOML config file. [env: SPOTGUARD_CONFIG] [default: /etc/spotguard/spotguard.toml]",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    envvar="SPOTGUARD_LOG_FORMAT",
    default="text",
    show_default=True,
    help="Log line format on stderr. [env: SPOTGUARD_LOG_FORMAT]",
)
@click.option(
    "--log-level",
    envvar="SPOTGUARD_LOG_LEVEL",
    type=click.Choice(log.LEVELS, case_sensitive=False),
    default=None,
    help="Log level. [env: SPOTGUARD_LOG_LEVEL] [default: warning; info for agent, "
    "controller, metadata-sim, notices, demo]",
)
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Log INFO lines too (as --log-level info; also accepted after a command).",
)
@click.pass_context
def main(
    ctx: click.Context, config: str | None, log_format: str, log_level: str | None, verbose: bool
) -> None:
    """spotguard — keep GPU jobs alive through spot interruptions and node drains."""
    level = log_level or log.default_level(ctx.invoked_subcommand, verbose=verbose)
    log.setup("json" if log_format == "json" else "text", level)
    ctx.obj = {"config": config}


def _verbose(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        log.verbose()


#: ``-v/--verbose`` on an interactive command (``spotguard park JOB --verbose``)
verbose_option = click.option(
    "-v",
    "--verbose",
    is_flag=True,
    expose_value=False,
    callback=_verbose,
    help="Log INFO lines too (steps, timings) on stderr.",
)


def config_file(ctx: click.Context) -> str | None:
    """The ``--config`` given to the top-level command (for subcommands)."""
    root = ctx.find_root()
    obj = root.obj or {}
    value = obj.get("config")
    return str(value) if value else None


def config(ctx: click.Context) -> ConfigFile:
    """The config file of this command line (``--config``, ``$SPOTGUARD_CONFIG`` or the
    default path), read and checked once on first use and then shared by every settings
    group the command loads."""
    root = ctx.find_root()
    if not isinstance(root.obj, dict):
        root.obj = {}
    from spotguard.config import ConfigFile

    held = root.obj.get("config_file")
    if not isinstance(held, ConfigFile):
        held = ConfigFile.read(config_file(ctx))
        root.obj["config_file"] = held
    return held
