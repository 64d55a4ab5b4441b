"""What several commands share: the ``[checkpoint]`` settings as flags, the few an operator
reaches for shown in ``--help`` and the advanced CRIU ones accepted but pointed to in the docs
(``park --help`` listed some fifteen CRIU flags before the park's own)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.cli import verbose_option
from spotguard.config import options
from spotguard.names import check_job_name

F = TypeVar("F", bound=Callable[..., Any])

#: the ``[checkpoint]`` settings every checkpointing command shows in its help
SHOWN = ("state_dir", "criu")

#: the epilog of a command whose advanced CRIU flags are hidden
ADVANCED = (
    "Advanced CRIU and staging settings (--criu-timeout, --gpu-timeout, --ghost-limit, "
    "--tcp-established, --network-lock, --shm-dir, ...) are accepted too and are best set once "
    "in [checkpoint] of the config: docs/agent.md, Configuration."
)


def checkpoint_options(*, exclude: tuple[str, ...] = ()) -> Callable[[F], F]:
    """``[checkpoint]`` flags (advanced ones hidden, see :data:`ADVANCED`) and ``--verbose``."""
    hidden = tuple(n for n in CheckpointSettings.model_fields if n not in SHOWN)
    opts = options(CheckpointSettings, exclude=exclude, hidden=hidden)

    def decorate(fn: F) -> F:
        return verbose_option(opts(fn))

    return decorate


def job_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback of an option naming a job: a name no job can have (``../x``, ``Train``) is a
    usage error before anything is opened, not a failure of the work (exit 1) or a bug's
    ``ValueError`` later."""
    if value is None:
        return None
    try:
        return check_job_name(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc


def no_inline_token(flag: str) -> Callable[[F], F]:
    """A hidden ``flag`` that refuses a token on the command line (``ps`` shows every
    process's arguments to every user of the host) with one line naming the safe ways."""
    from spotguard.errors import ConfigError

    def refuse(ctx: Any, param: Any, value: str | None) -> None:
        if value is not None:
            raise ConfigError(
                f"{flag} would show the token to every user of this host (ps): set "
                "SPOTGUARD_CONTROLLER_TOKEN, or controller_token_file (--controller-token-file, "
                "SPOTGUARD_CONTROLLER_TOKEN_FILE) naming a file that holds it"
            )

    return click.option(flag, default=None, hidden=True, expose_value=False, callback=refuse)
